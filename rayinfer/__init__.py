"""rayinfer: an LLM inference service on Ray (engine, prefill/decode disaggregation, KV store, EPLB).

The top-level folders of the checkout (actors/, engine/, model/, placement/, policy/, serve/, data/, conf/,
jobs/) are the subpackages ``rayinfer.<folder>``: this directory holds a link to each, so the import system
and static tools resolve ``rayinfer.*`` alike (docs/architecture.md has the map). ``rayinfer/kernels/`` lives
here itself: a top-level ``kernels`` folder would shadow Hugging Face's ``kernels`` package, which
transformers imports whenever the checkout's root is on ``sys.path``.
"""

__version__ = "0.1.0"
