# Two commands on a fresh machine: `make demo` (the matrix on the embedded stack) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, from the pinned CPU build, so that nothing below pulls a multi-GB CUDA build; the
# package is then built against it without build isolation.
$(STAMP): $(PY) pyproject.toml setup.py
	$(PIP) install -q torch==2.13.0 setuptools wheel ninja
	$(PIP) install -q --no-build-isolation -e ".[test,orchestration]"
	touch $(STAMP)

install: $(STAMP)

# Rebuild the extension when csrc/ or include/ changed, then run every test.
test: install
	$(PIP) install -q --no-build-isolation --no-deps -e .
	$(PY) -m pytest tests -q

demo: install
	$(VENV)/bin/rlk demo

bench: install
	$(PY) benchmarks/cpu_ops.py

clean:
	rm -rf build *.egg-info rl_engine/*.so
