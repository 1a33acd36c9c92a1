"""Variable-length attention for packed rows on GPUs without flash-attn, registered as a transformers attention
implementation.

Two kernels (``training.packed_varlen_kernel``):

- ``op`` (``rm_varlen``, the default): ``trainer.packing.varlen_kernel``'s custom op over aten's flash kernels. Grouped-
  query attention without repeating the keys and values, and traced by ``torch.compile`` as one call, so a compiled
  decoder layer is one region.
- ``api`` (``rm_varlen_api``): PyTorch's public ``torch.nn.attention.varlen.varlen_attn``, with the keys and values
  repeated to the query heads and kept out of compiled graphs (``torch.compiler.disable``). The fallback where aten's
  private flash signatures differ from the ones the op calls.

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

from trainer.packing.varlen_kernel import flash_kernels_available, varlen_attention

VARLEN_IMPL = "rm_varlen"
VARLEN_API_IMPL = "rm_varlen_api"
#: ``training.packed_varlen_kernel`` → the attention implementation it registers
VARLEN_KERNELS = {"op": VARLEN_IMPL, "api": VARLEN_API_IMPL}
_REGISTERED: set[str] = set()
_SIDE_CHANNEL: dict[str, object] = {}


def varlen_available(kernel: str = "op") -> bool:
    """True when the packed varlen ``kernel`` can run here: a CUDA device with torch's flash attention (``op``), or
    with the ``torch.nn.attention.varlen`` module (``api``)."""
    if kernel == "op":
        return flash_kernels_available()
    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _causal_kwargs(fn) -> dict:
    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        return {"is_causal": True}
    return {"window_size": (-1, 0)}


def _segment_layout(query: torch.Tensor, kwargs: dict, with_max_len: bool = True) -> tuple[torch.Tensor, int | None]:
    """The row's ``cu_seq_lens`` and, ``with_max_len``, its longest segment: from the model kwargs (text batches) or
    the side channel (multimodal). Compiled callers pass ``with_max_len=False``: reading the Python int would make
    Dynamo guard on its value."""
    from_kwargs = kwargs.get("cu_seq_lens_q") is not None
    cu = kwargs.get("cu_seq_lens_q") if from_kwargs else _SIDE_CHANNEL.get("cu")
    if cu is None:
        raise ValueError("rm_varlen attention needs cu_seq_lens_q and max_length_q (a packed batch)")
    if query.shape[0] != 1:
        raise ValueError(f"rm_varlen attention expects one packed row, got batch size {query.shape[0]}")
    if not with_max_len:
        return cu, None
    max_len = kwargs.get("max_length_q") if from_kwargs else _SIDE_CHANNEL.get("max_len")
    if max_len is None:
        raise ValueError("rm_varlen attention needs cu_seq_lens_q and max_length_q (a packed batch)")
    return cu, max_len


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float32 query/key/value cast to the autocast dtype where autocast is on (float32 master weights: a float32
    norm weight widens q and k after the projection), as transformers' flash-attention integration does; else as
    given."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device) or tensors[0].dtype != torch.float32:
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention interface (``rm_varlen``): query [1, Hq, L, D], key/value [1, Hkv, L, D] →
    ([1, L, Hq, D], None), through ``trainer.packing.varlen_kernel``'s op.

    Traced by ``torch.compile`` (``training.compile_decoder_layers``) as one call: compiled, the kernel's segment bound
    is the row length (a dynamic shape), never the side channel's ``max_len`` (a Python int that changes with every
    pack and would be guarded on, recompiling the layers at every step)."""
    if dropout:
        raise ValueError(f"rm_varlen attention has no dropout (got {dropout}); set the model's attention_dropout to 0")
    compiling = torch.compiler.is_compiling()
    cu, max_len = _segment_layout(query, kwargs, with_max_len=not compiling)
    q, k, v = (t[0].transpose(0, 1) for t in autocast_inputs(query, key, value))
    bound = q.shape[0] if compiling else int(max_len)
    out, _ = varlen_attention(q, k, v, cu.to(device=q.device, dtype=torch.int32), bound, scaling)
    return out[None], None


@torch.compiler.disable
def varlen_api_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, **kwargs):
    """transformers attention interface (``rm_varlen_api``): query/key/value [1, H, L, D] → ([1, L, H, D], None),
    through ``torch.nn.attention.varlen.varlen_attn`` with the keys and values repeated to the query heads.

    Never traced by ``torch.compile``: the segment layout (``max_len``) would be guarded on and recompile the
    compiled layers at every step; the layer compiles around the call instead (a graph break per layer)."""
    from torch.nn.attention.varlen import varlen_attn

    cu, max_len = _segment_layout(query, kwargs)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in autocast_inputs(query, key, value))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, int(max_len), int(max_len), scale=scaling, **_causal_kwargs(varlen_attn))
    return out[None], None


def unguarded_segment_counts(*cu_seq_lens: torch.Tensor | None) -> None:
    """Mark each segment-bounds tensor's length unbacked for Dynamo, before a compiled layer sees it: the layer then
    neither guards on the number of segments nor ties it to an equal size elsewhere (duck sizing: ``cu_seq_lens``
    of 17 entries beside 16 query heads plus one, say), so no pack layout recompiles the layers."""
    from torch._dynamo.decorators import mark_unbacked

    for cu in cu_seq_lens:
        if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2:
            mark_unbacked(cu, 0)


def _no_mask(*args, **kwargs):
    return None


def register_varlen_attention(kernel: str = "op") -> str:
    """Register the packed varlen ``kernel`` (``op`` | ``api``) with transformers; returns its implementation name."""
    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"packed varlen kernel {kernel!r}: one of {', '.join(VARLEN_KERNELS)}")
    name = VARLEN_KERNELS[kernel]
    if name not in _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        forward = varlen_attention_forward if kernel == "op" else varlen_api_attention_forward
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, _no_mask)
        _REGISTERED.add(name)
    return name


def choose_packed_attention(configured: str | None, multimodal: bool = False, kernel: str = "op") -> str:
    """The attention implementation for packed rows: the configured one, else flash-attn (text models), else
    the packed varlen ``kernel`` on CUDA (text and multimodal: the latter through the side channel), else sdpa with a
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
        if varlen_available(kernel):
            return register_varlen_attention(kernel)
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
            unguarded_segment_counts(cu_seq_lens)
            _SIDE_CHANNEL.update(cu=cu_seq_lens, max_len=int(max_length))
        yield
    finally:
        _SIDE_CHANNEL.clear()
        for c, old in before:
            c._attn_implementation = old
