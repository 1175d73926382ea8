# Two commands on a fresh machine: `make demo` and `make test`.
# The tests mostly wait on servers (the simulator, Valkey, dagster subprocesses), so three pytest-xdist
# workers share 2 cores; each worker has its own servers and its own database of REDIS_URL.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# tiktoken downloads its encodings on first use; this repo's sibling shared/ holds them for offline machines.
TIKTOKEN_DIR := $(firstword $(wildcard ../shared/tiktoken) $(wildcard ./shared/tiktoken))
ifneq ($(TIKTOKEN_DIR),)
export TIKTOKEN_CACHE_DIR ?= $(abspath $(TIKTOKEN_DIR))
endif

.PHONY: install test lint format check demo dev bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check batch_llm_assets tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist worksteal

lint: $(STAMP)
	$(PY) -m ruff check batch_llm_assets tests benchmarks
	$(PY) -m ruff format --check batch_llm_assets tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format batch_llm_assets tests benchmarks
	$(PY) -m ruff check --fix batch_llm_assets tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/utilization.py
	$(PY) benchmarks/utilization.py --processes 4
	$(PY) benchmarks/overhead.py

check: $(STAMP)
	$(VENV)/bin/dg check defs

clean:
	rm -rf $(VENV) .demo .pytest_cache

demo: $(STAMP)
	$(PY) -m batch_llm_assets.demo run --partitions 3

# The UI (`dg dev`) with the simulator and Valkey; Ctrl-C or SIGTERM stops every child, and so
# does killing make itself.
dev: $(STAMP)
	$(PY) -m batch_llm_assets.demo dev
