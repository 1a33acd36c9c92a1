"""Packed variable-length attention as one torch custom op, ``rollout_matching::varlen_attention``, with its own
backward op.

``torch.compile`` (``training.compile_decoder_layers``) traces it as a single opaque call inside a compiled decoder
layer: no graph break, so each layer stays one compiled region. A compiled caller passes the row length as
``max_len`` (any bound on the longest segment is correct; the row length is a shape the dynamic graph already has)
and marks the segment count unbacked (``trainer.packing.varlen_attention.unguarded_segment_counts``), so a new pack
never recompiles.

On CUDA the op runs aten's flash-attention kernels (``_flash_attention_forward`` / ``_backward``, the kernels under
``torch.nn.attention.varlen``), which take fewer key/value heads than query heads (grouped-query attention): the keys
and values are neither repeated to the query heads nor saved repeated. Elsewhere it runs a causal attention per
segment in float32 (or the inputs' wider dtype): the reference the CPU tests compile and the GPU tests hold the
flash kernels to.

Layout: ``query [T, Hq, D]``, ``key`` / ``value [T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``), ``cu_seq_lens [N + 1]``
int32 segment bounds from 0 to ``T``. Returns ``(out [T, Hq, D], logsumexp)``. Causal within each segment, nothing
across segments. Dropout is not supported (the packed forward trains without attention dropout).
"""

from __future__ import annotations

import torch

OP_NAME = "rollout_matching::varlen_attention"


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"varlen_attention: query [T, Hq, D] and key/value [T, Hkv, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"varlen_attention: {query.shape[1]} query heads is not a multiple of {key.shape[1]} "
                         "key/value heads")
    if cu_seq_lens.dtype != torch.int32 or cu_seq_lens.dim() != 1:
        raise ValueError(f"varlen_attention: cu_seq_lens must be 1-D int32, got {cu_seq_lens.dtype} "
                         f"{tuple(cu_seq_lens.shape)}")


def _segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
              scale: float | None):
    """Per segment: its bounds, ``q [Hq, n, D]``, ``k``/``v`` repeated to ``Hq`` heads (float32 at least), and the
    scaled, causally masked scores."""
    rep = query.shape[1] // key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    s = query.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seq_lens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1).to(dtype) for t in (query, key, value))
        if rep > 1:
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=query.device).tril()
        yield a, b, q, k, v, ((q @ k.transpose(-1, -2)) * s).masked_fill(~causal, float("-inf")), s


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: causal softmax attention within each segment, in float32 at least → ``(out [T, Hq, D]`` in the
    query's dtype, ``logsumexp [Hq, T]``)."""
    outs, lses = [], []
    for _, _, _, _, v, scores, _ in _segments(query, key, value, cu_seq_lens, scale):
        lse = scores.logsumexp(-1)
        outs.append((torch.exp(scores - lse[..., None]) @ v).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(query.dtype), torch.cat(lses, dim=-1).float()


def segment_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cu_seq_lens: torch.Tensor, scale: float | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's gradients for query, key and value (the key/value ones summed over each group of query
    heads), from the softmax recomputed in float32 at least."""
    hq, hkv = query.shape[1], key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (query, key, value))
    for a, b, q, k, v, scores, s in _segments(query, key, value, cu_seq_lens, scale):
        p = torch.softmax(scores, dim=-1)
        g = grad_out[a:b].transpose(0, 1).to(dtype)
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * s
        dq[a:b] = (ds @ k).transpose(0, 1)
        dk[a:b] = (ds.transpose(-1, -2) @ q).reshape(hkv, hq // hkv, b - a, -1).sum(1).transpose(0, 1)
        dv[a:b] = (p.transpose(-1, -2) @ g).reshape(hkv, hq // hkv, b - a, -1).sum(1).transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@torch.library.custom_op(OP_NAME, mutates_args=())
def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                     max_len: int, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``max_len``: at least the longest segment (the flash kernels size their grid with it)."""
    _check(query, key, value, cu_seq_lens)
    return segment_attention(query, key, value, cu_seq_lens, scale)


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


@varlen_attention.register_kernel("cuda")
def _varlen_attention_cuda(query, key, value, cu_seq_lens, max_len, scale):
    _check(query, key, value, cu_seq_lens)
    if not query.dtype == key.dtype == value.dtype or query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"varlen_attention on CUDA (flash kernels): query/key/value must share float16 or bfloat16, "
                         f"got {query.dtype}/{key.dtype}/{value.dtype}; run the packed forward in bf16")
    q, k, v = _contiguous(query, key, value)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seq_lens, cu_seq_lens, max_len, max_len, 0.0,
                                                             True, False, scale=scale)
    return out, lse


@varlen_attention.register_fake
def _varlen_attention_fake(query, key, value, cu_seq_lens, max_len, scale):
    if query.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(query, key, value, cu_seq_lens, cu_seq_lens, max_len,
                                                                 max_len, 0.0, True, False, scale=scale)
        return torch.empty_like(query), lse
    return torch.empty_like(query), query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)


@torch.library.custom_op("rollout_matching::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, logsumexp: torch.Tensor, cu_seq_lens: torch.Tensor, max_len: int,
                              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``varlen_attention`` for query, key and value (key/value ones with ``Hkv`` heads)."""
    return segment_attention_backward(grad_out, query, key, value, cu_seq_lens, scale)


@varlen_attention_backward.register_kernel("cuda")
def _varlen_attention_backward_cuda(grad_out, query, key, value, out, logsumexp, cu_seq_lens, max_len, scale):
    g, q, k, v, o = _contiguous(grad_out, query, key, value, out)
    # dropout is off: the philox state is never read (what torch.nn.attention.varlen passes as well)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(g, q, k, v, o, logsumexp, cu_seq_lens, cu_seq_lens, max_len,
                                                          max_len, 0.0, True, rng_state, unused, scale=scale)
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(grad_out, query, key, value, out, logsumexp, cu_seq_lens, max_len, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seq_lens, max_len, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seq_lens)
    ctx.max_len, ctx.scale = max_len, scale


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seq_lens = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(grad_out, query, key, value, out, lse, cu_seq_lens, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def flash_kernels_available() -> bool:
    """True when this process can run the op's CUDA kernels (a CUDA device and torch's flash attention)."""
    return torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available()
