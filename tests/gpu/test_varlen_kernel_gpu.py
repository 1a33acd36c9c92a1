"""GPU-only: ``trainer.packing.varlen_kernel``'s CUDA kernels (aten's flash attention) against the per-segment
reference and against torch's public ``varlen_attn`` with K/V repeated (the ``api`` kernel), at Qwen3-VL 4B's head
layout (32 query heads, 8 key/value heads, head dim 128), bf16; and compiled, with no graph break and no recompile
across segment layouts.

Run: ``python -m pytest -m gpu tests/gpu/test_varlen_kernel_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from trainer.packing.varlen_kernel import flash_kernels_available, segment_attention, segment_attention_backward
from trainer.packing.varlen_kernel import varlen_attention as varlen_op

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flash_kernels_available(), reason="needs CUDA + torch flash attention")]


def _inputs(lengths, hq=32, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("heads", [(32, 8), (16, 16)])
@pytest.mark.parametrize("bound", ["exact", "row"])
def test_flash_kernels_match_the_reference(heads, bound):
    """Forward, logsumexp and gradients against the float32 reference on the same bf16 inputs; ``row``: the bound a
    compiled layer passes (the row length) gives the same result as the exact longest segment."""
    lengths = [700, 1300, 1, 257, 2048]
    q, k, v, cu = _inputs(lengths, *heads)
    max_len = max(lengths) if bound == "exact" else sum(lengths)
    out, lse = varlen_op(q, k, v, cu, max_len, 128 ** -0.5)
    ref, ref_lse = segment_attention(q.detach(), k.detach(), v.detach(), cu, 128 ** -0.5)
    assert out.shape == q.shape and _rel(out, ref) < 1e-2
    assert torch.allclose(lse.float().reshape(ref_lse.shape), ref_lse, atol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = segment_attention_backward(grad, q.detach(), k.detach(), v.detach(), cu, 128 ** -0.5)
    for g, w, t in zip(got, want, (q, k, v)):
        assert g.shape == t.shape and _rel(g, w) < 2e-2, (t.shape, _rel(g, w))


def test_op_matches_the_public_varlen_api_with_repeated_heads():
    """The ``op`` kernel and the ``api`` kernel (torch's varlen_attn, K/V repeated) agree on output and gradients."""
    from torch.nn.attention.varlen import varlen_attn

    from trainer.packing.varlen_attention import _causal_kwargs

    lengths = [3000, 4096, 2500, 6788]
    q, k, v, cu = _inputs(lengths)
    out, _ = varlen_op(q, k, v, cu, max(lengths), None)
    rep = q.shape[1] // k.shape[1]
    api = varlen_attn(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, cu, max(lengths), max(lengths),
                      **_causal_kwargs(varlen_attn))
    assert _rel(out, api) < 5e-3
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(api, (q, k, v), grad)):
        assert _rel(a, b) < 1e-2


def test_compiled_caller_keeps_one_graph_on_cuda():
    """Inductor with the op inside: no graph break, no recompile across segment layouts, the eager result."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from trainer.modeling.fixtures import build_tiny_model
    from trainer.packing.varlen_attention import packed_attention, register_varlen_attention, varlen_attention_forward

    model, _ = build_tiny_model("vl", seed=0)
    impl = register_varlen_attention("op")

    def layer(q, k, v):
        out, _ = varlen_attention_forward(None, torch.nn.functional.silu(q), k, v, None, scaling=0.125)
        return out * 2

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    for lengths in ([900, 1200, 64], [2048, 17], [5, 5, 3000, 700, 1], [1500, 1500]):
        q, k, v, cu = _inputs(lengths, seed=len(lengths))
        q4, k4, v4 = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
        with packed_attention(model, impl, cu, max(lengths)):
            got = compiled(q4, k4, v4)
            want = layer(q4, k4, v4)
            g_got = torch.autograd.grad(got.float().square().sum(), (q4, k4, v4))
            g_want = torch.autograd.grad(want.float().square().sum(), (q4, k4, v4))
        assert _rel(got, want) < 1e-2
        assert all(_rel(a, b) < 2e-2 for a, b in zip(g_got, g_want))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counter.frame_count <= 2, counter.frame_count
