"""The one random-weight model builder of the benchmarks, and the shapes they use.

Every benchmark builds a ``Qwen3ForCausalLM`` from ``Qwen3Config`` directly (no checkpoint, no download): the
Qwen3-0.6B shape from ``trainer.modeling.shapes`` on a GPU, ``TINY`` for CPU smoke runs. No pydantic, no config.
"""

from __future__ import annotations

import torch

from trainer.modeling.shapes import QWEN3_0_6B

__all__ = ["QWEN3_0_6B", "TINY", "device_name", "peak_bf16_tflops", "random_qwen3", "sync"]

TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64)
#: dense BF16 tensor-core peaks (TFLOPS, without sparsity) by a substring of the name CUDA reports; the first match
#: wins, so a card's variant comes before its family
DENSE_BF16_TFLOPS = (("H100 PCIe", 756.5), ("H100 NVL", 835.5), ("H200 NVL", 835.5), ("H100", 989.0),
                     ("H200", 989.0), ("A100", 312.0))


def peak_bf16_tflops(name: str) -> float | None:
    """The dense BF16 peak of the GPU CUDA calls ``name`` (``None`` for a GPU not in ``DENSE_BF16_TFLOPS`` or the
    CPU): what a published MFU divides by, so that a figure is never taken against another card's peak."""
    return next((peak for key, peak in DENSE_BF16_TFLOPS if key in name), None)


def random_qwen3(shape: dict[str, int] | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int | None = 0, attn_implementation: str = "sdpa",
                 max_position_embeddings: int = 32768, pad_token_id: int | None = 0, eos_token_id: int | None = None,
                 train: bool = False, gradient_checkpointing: bool = False):
    """Random-weight ``Qwen3ForCausalLM`` with tied embeddings, built on ``device`` in ``dtype``.

    ``shape`` holds ``Qwen3Config`` dimensions (default Qwen3-0.6B); missing keys fall back to Qwen3-0.6B.
    ``seed``: ``torch.manual_seed`` before the weights are drawn (``None`` leaves the global RNG as it is).
    ``eos_token_id=None`` also clears the generation config's, so decoding always runs to ``max_new_tokens``.
    ``train`` returns the model in train mode (``gradient_checkpointing``: non-reentrant activation checkpointing).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = {**QWEN3_0_6B, **(shape or {})}
    cfg = Qwen3Config(**dims, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    cfg._attn_implementation = attn_implementation
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    if not train:
        return model.eval()
    model.train()
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def sync(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA), so wall-clock timings cover it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
