"""The random-weight models of the benchmarks and the shapes they use (no checkpoint, no download).

``random_qwen3``: a ``Qwen3ForCausalLM`` (the Qwen3-0.6B shape from ``trainer.modeling.shapes`` on a GPU, ``TINY`` for
CPU smoke runs), ``save_random_model_dir`` its directory with the embedded tokenizer; ``save_random_vl_model``: a
Qwen3-VL at a published size (2B / 4B / 8B, vision tower included) or ``tiny``, with an image processor;
``param_counts`` / ``adapter_params``: what the FLOP count of ``trainer.bench.measure`` multiplies.
"""

from __future__ import annotations

import functools
import gc
import re
import time
from pathlib import Path

import torch

from trainer.modeling.shapes import QWEN3_0_6B

__all__ = ["QWEN3_0_6B", "TINY", "peak_bf16_tflops", "random_qwen3", "save_random_model_dir", "save_random_vl_model"]

TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64)
#: a small text decoder over the embedded tokenizer's ids (CPU peers and smoke runs)
CPU_SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)
GPU_SHAPE = dict(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64)
#: published Qwen3-VL-{2B,4B,8B}-Instruct ``config.json`` dimensions (text model / vision tower).
QWEN3_VL_TEXT = {
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
QWEN3_VL_VISION = {
    "2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
               deepstack_visual_indexes=[5, 11, 17]),
    "4b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
               deepstack_visual_indexes=[5, 11, 17]),
    "8b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
               deepstack_visual_indexes=[8, 16, 24]),
}
TIED = {"2b": True, "4b": True, "8b": False}
VOCAB = 151936
#: the tiny shape's head counts divide by 1, 2 and 4, so that vLLM TP groups of those sizes can serve it
TINY_TEXT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=64)
TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                   deepstack_visual_indexes=[0])


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


def save_random_model_dir(out: Path, shape: dict[str, int] | None = None, dtype=torch.bfloat16) -> Path:
    """A random ``random_qwen3`` model directory with the embedded tokenizer (whose ids fit in its vocabulary) and no
    EOS, so decoding always runs to ``max_tokens``."""
    from trainer.modeling.fixtures import tiny_tokenizer

    if (out / "config.json").is_file():
        return out
    tok = tiny_tokenizer()
    dims = {**QWEN3_0_6B, **(shape or {})}
    if dims["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {dims['vocab_size']} is smaller than the tokenizer's {len(tok)}")
    model = random_qwen3(dims, dtype=dtype, eos_token_id=None, max_position_embeddings=4096)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def vl_config(size: str):
    """``Qwen3VLConfig`` of a published size (or ``tiny``), with the embedded tokenizer's special-token ids."""
    from transformers import Qwen3VLConfig

    from trainer.modeling.fixtures import (
        IM_END,
        IMAGE_PAD,
        PAD_TOKEN,
        VIDEO_PAD,
        VISION_END,
        VISION_START,
        tiny_tokenizer,
    )

    tok = tiny_tokenizer()
    tiny = size == "tiny"
    text = {**(TINY_TEXT if tiny else QWEN3_VL_TEXT[size]), "vocab_size": len(tok) if tiny else VOCAB,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "pad_token_id": tok.convert_tokens_to_ids(PAD_TOKEN), "eos_token_id": tok.convert_tokens_to_ids(IM_END),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0 if tiny else 5_000_000.0,
                                "mrope_section": [12, 10, 10] if tiny else [24, 20, 20], "mrope_interleaved": True}}
    vision = {**(TINY_VISION if tiny else QWEN3_VL_VISION[size]), "patch_size": 16, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 64 if tiny else 2304}
    return Qwen3VLConfig(text_config=text, vision_config=vision,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
                         video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
                         vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
                         vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
                         tie_word_embeddings=True if tiny else TIED[size])


def save_random_vl_model(out: Path, size: str, device: str) -> tuple[Path, dict[str, float]]:
    """A random-weight Qwen3-VL model directory (weights drawn on ``device``, bf16 on a GPU), with the embedded
    tokenizer and a Qwen3-VL image processor (16 px patches, 2x2 merge; up to 4096x4096 pixels). Returns the
    directory and the build / save seconds."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    from trainer.modeling.fixtures import tiny_tokenizer

    times: dict[str, float] = {}
    if (out / ".complete").is_file():
        return out, times
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(vl_config(size), dtype=dtype)
    model.generation_config.eos_token_id = None
    if device != "cpu":
        torch.cuda.synchronize()
    times["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096}).save_pretrained(out)
    times["save_s"] = time.perf_counter() - t0
    del model
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    (out / ".complete").write_text(size)
    return out, times


@functools.cache
def meta_model(size: str):
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        return Qwen3VLForConditionalGeneration._from_config(vl_config(size))


def param_counts(size: str) -> dict[str, int]:
    """Parameters of the language model's blocks (no embeddings / lm_head) and of the vision tower."""
    model = meta_model(size)
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "visual" not in n)
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    total = sum(p.numel() for p in model.parameters())
    return {"text_blocks": blocks, "vision": vision, "total": total}


def adapter_params(size: str, rank: int) -> int:
    """Parameters of a rank-``rank`` LoRA on the linears the product adapts in a multimodal model with a frozen
    vision tower (``trainer.modeling.loading.LANGUAGE_PROJECTIONS``): rank x (in + out) per linear."""
    from trainer.modeling.loading import LANGUAGE_PROJECTIONS

    return sum(rank * (m.in_features + m.out_features) for n, m in meta_model(size).named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(LANGUAGE_PROJECTIONS, n))
