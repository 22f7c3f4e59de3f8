"""rayinfer: an LLM inference service on Ray (engine, prefill/decode disaggregation, KV store, EPLB).

The top-level folders of the checkout (actors/, engine/, model/, kernels/, placement/, serve/, conf/,
jobs/) are the subpackages ``rayinfer.<folder>``; pyproject.toml maps them.
"""

__version__ = "0.1.0"
