# Both targets create or refresh .venv and install lrjax (with its C++ extension) into it.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
BUILD_DEPS := "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2,<0.12" "jaxlib>=0.10.2,<0.12"

.PHONY: venv demo test test-gpu clean

# `make test` installs triton (no GPU needed) before building: it runs the kernel-logic tests in
# Triton's CPU interpreter, compiles the kernels for the H200 to check their shared memory, and
# its cuda.h lets CMake build the Triton launcher (custom_calls/triton/pdl_launch.cc)
EXTRA_DEPS ?=

venv:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(BUILD_DEPS)
	$(if $(EXTRA_DEPS),$(PIP) install -q $(EXTRA_DEPS) || echo 'triton not installable here: the tests that need it will skip')
	$(PIP) install -q --no-build-isolation -e ".[test]"

demo: venv
	$(VPY) examples/demo.py

test: EXTRA_DEPS = "triton>=3.6,<3.7"
test: venv
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(VPY) -m pytest -q -rs -n 2 tests

# four workers share one GPU (each XLA client takes 22 % of its memory): the whole GPU suite took
# 6 min on one H200 this way, 16 min in one process
GPU_WORKERS ?= 4
test-gpu:
	XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 $(VPY) -m pytest -q -m gpu -n $(GPU_WORKERS) tests

clean:
	rm -rf build dist $(VENV) .pytest_cache
