"""rayinfer: an LLM inference service on Ray (engine, prefill/decode disaggregation, KV store, EPLB).

The top-level folders of the checkout (actors/, engine/, model/, kernels/, placement/, policy/, serve/, data/,
conf/, jobs/) are the subpackages ``rayinfer.<folder>``: this directory holds a link to each, so the
import system and static tools resolve ``rayinfer.*`` alike (docs/architecture.md has the map).
"""

__version__ = "0.1.0"
