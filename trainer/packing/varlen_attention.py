"""Variable-length attention for packed rows on GPUs without flash-attn: PyTorch's
``torch.nn.attention.varlen.varlen_attn`` registered as a transformers attention implementation.

``packed_attention(model, impl)`` swaps the text model's attention implementation only around the packed
forward and its backward (rollout generation keeps its own, padded, implementation). Text batches carry
``cu_seq_lens_q/k`` and ``max_length_q/k`` as model kwargs. Multimodal batches carry them as
``packed_cu_seq_lens`` / ``packed_max_length`` instead, handed to ``packed_attention`` (a process-wide side channel,
visible to the autograd threads that recompute checkpointed layers): as model kwargs they would reach the vision
encoder, which keeps its own attention. Attention never crosses a segment boundary.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

VARLEN_IMPL = "rm_varlen"
_REGISTERED = False
_SIDE_CHANNEL: dict[str, object] = {}


def varlen_available() -> bool:
    """True when PyTorch's varlen attention can run here (CUDA + the varlen module)."""
    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _causal_kwargs(fn) -> dict:
    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        return {"is_causal": True}
    return {"window_size": (-1, 0)}


@torch.compiler.disable
def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention interface: query/key/value [1, H, L, D] → ([1, L, H, D], None).

    Never traced by ``torch.compile`` (``training.compile_decoder_layers``): the segment layout (the side channel's
    ``max_len``, a Python int that changes with every pack) would otherwise be guarded on and recompile the compiled
    layers at every step; the layer compiles around the attention call instead."""
    from torch.nn.attention.varlen import varlen_attn

    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None and "cu" in _SIDE_CHANNEL:
        cu, max_len = _SIDE_CHANNEL["cu"], _SIDE_CHANNEL["max_len"]
    if cu is None or max_len is None:
        raise ValueError("rm_varlen attention needs cu_seq_lens_q and max_length_q (a packed batch)")
    if query.shape[0] != 1:
        raise ValueError(f"rm_varlen attention expects one packed row, got batch size {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, int(max_len), int(max_len), scale=scaling, **_causal_kwargs(varlen_attn))
    return out[None], None


def _no_mask(*args, **kwargs):
    return None


def register_varlen_attention() -> str:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(VARLEN_IMPL, varlen_attention_forward)
        AttentionMaskInterface.register(VARLEN_IMPL, _no_mask)
        _REGISTERED = True
    return VARLEN_IMPL


def choose_packed_attention(configured: str | None, multimodal: bool = False) -> str:
    """The attention implementation for packed rows: the configured one, else flash-attn (text models), else
    PyTorch varlen on CUDA (text and multimodal: the latter through the side channel), else sdpa with a
    block-diagonal mask (correct everywhere, slower for long rows)."""
    if configured:
        return configured
    if torch.cuda.is_available():
        if not multimodal:
            try:
                import flash_attn  # noqa: F401

                return "flash_attention_2"
            except ImportError:
                pass
        if varlen_available():
            return register_varlen_attention()
    return "sdpa"


@contextmanager
def packed_attention(model, impl: str, cu_seq_lens: torch.Tensor | None = None,
                     max_length: int | None = None) -> Iterator[None]:
    """Temporarily set the language model's attention implementation (restored on exceptions too); with
    ``cu_seq_lens`` the varlen kernel reads the segment boundaries from the side channel."""
    text_cfg = model.config.get_text_config()
    multimodal = text_cfg is not model.config
    configs = [text_cfg] if multimodal else [model.config]
    before = [(c, c._attn_implementation) for c in configs]
    if cu_seq_lens is not None and _SIDE_CHANNEL:
        raise RuntimeError("packed_attention side channel already in use (nested packed forwards)")
    try:
        for c, _ in before:
            c._attn_implementation = impl
        if cu_seq_lens is not None:
            _SIDE_CHANNEL.update(cu=cu_seq_lens, max_len=int(max_length))
        yield
    finally:
        _SIDE_CHANNEL.clear()
        for c, old in before:
            c._attn_implementation = old
