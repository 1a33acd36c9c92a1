# rollout-matching — set-up, demo, tests. Every target sets up what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export TOKENIZERS_PARALLELISM := false
export VLLM_PLUGINS :=

.PHONY: setup demo test test-fast lint bench clean
.DEFAULT_GOAL := help

help:
	@echo "make demo   - CPU demo: tiny model + synthetic data, stage-1 warm-up then stage-2 rollout-matching"
	@echo "make test   - the full test suite (sets everything up first)"
	@echo "make lint   - ruff"
	@echo "make bench  - benchmarks (GPU machine), JSON + PNG under docs/benchmarks/"

$(VENV)/.installed: pyproject.toml $(wildcard mk/*.mk)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(MAKE) -s extra-setup
	touch $@

setup: $(VENV)/.installed

extra-setup::
	@true

demo: setup
	$(PY) -m trainer demo --config configs/demo.yaml

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	$(PY) -m ruff check trainer tests

bench: setup
	$(PY) -m trainer bench

clean:
	rm -rf runs .pytest_cache

-include mk/*.mk
