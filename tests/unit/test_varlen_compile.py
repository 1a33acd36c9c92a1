"""The packed varlen attention with ``training.compile_decoder_layers``.

``op`` (``trainer.packing.varlen_kernel``): one custom op that Dynamo traces as a single call, so a compiled layer
has no graph break (each compiled decoder layer ran as 4 Dynamo regions before, ~0.57 ms of host time a region call
on the H100, 2026-11-27), and a new segment layout (new ``max_len`` and segment count every step) does not
recompile. On the H100 the compiled 2B Qwen3-VL once recompiled at every step (forward 6.4-6.7 s vs 0.30 s eager).
Its CPU kernel is the per-segment reference; the GPU tests hold the flash kernels to it.

``api``: torch's public ``varlen_attn`` kept out of the graph (a graph break); its CUDA kernel is replaced here by a
per-segment causal SDPA with the same signature."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from trainer.modeling.fixtures import build_tiny_model
from trainer.packing import varlen_attention
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention
from trainer.packing.varlen_kernel import varlen_attention as varlen_op


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    assert window_size == (-1, 0) and max_q == max(torch.diff(cu_q).tolist())
    bounds = cu_q.tolist()
    out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                          scale=scale).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out)


def sdpa_per_segment(q, k, v, cu, scale):
    """[T, Hq, D] from causal SDPA run on each segment alone, K/V repeated to the query heads."""
    rep = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    return torch.cat([F.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(rep, 0),
        v[a:b].transpose(0, 1).repeat_interleave(rep, 0), is_causal=True, scale=scale).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_op_matches_sdpa_per_segment_with_grouped_key_value_heads(heads):
    """Output and gradients against SDPA on each segment alone; key/value gradients keep ``Hkv`` heads (summed over
    each group of query heads, never repeated)."""
    torch.manual_seed(0)
    hq, hkv = heads
    cu = torch.tensor([0, 5, 12, 13, 20], dtype=torch.int32)
    q = torch.randn(20, hq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(20, hkv, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = varlen_op(q, k, v, cu, 7, 0.3)
    want = sdpa_per_segment(q, k, v, cu, 0.3)
    assert torch.allclose(out, want, atol=1e-10) and lse.shape == (hq, 20)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for g, r, t in zip(got, ref, (q, k, v)):
        assert g.shape == t.shape and torch.allclose(g, r, atol=1e-10)
    segment = 5  # a query row that is its segment's first token attends to itself only
    assert torch.allclose(out[segment], v[segment].repeat_interleave(hq // hkv, 0), atol=1e-12)


def test_op_passes_torch_custom_op_checks():
    """Schema, fake (meta) kernel, autograd registration and Dynamo/AOT tracing, by ``torch.library.opcheck``."""
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    torch.library.opcheck(torch.ops.rollout_matching.varlen_attention.default, (q, k, v, cu, 6, None))
    torch.library.opcheck(torch.ops.rollout_matching.varlen_attention.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, 6, 0.5))


def test_op_names_what_is_wrong():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        varlen_op(torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), cu, 4, None)
    with pytest.raises(ValueError, match="int32"):
        varlen_op(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), cu.long(), 4, None)


LAYOUTS = ([5, 7, 4], [9, 3], [2, 2, 2, 10], [6, 6, 6, 6, 1])


@pytest.mark.parametrize("kernel", ["op", "api"])
def test_new_segment_layouts_do_not_recompile(monkeypatch, kernel):
    """Both kernels: never a compile per layout. ``op`` traces as one graph without a break, compiled once: the
    segment count is unbacked (``unguarded_segment_counts``), so it is neither guarded on nor duck-sized with the
    head count; ``api`` breaks the graph at the attention call and may compile once more when sizes turn symbolic."""
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", reference_varlen)
    model, _ = build_tiny_model("vl", seed=0)
    impl = register_varlen_attention(kernel)
    forward = (varlen_attention.varlen_attention_forward if kernel == "op"
               else varlen_attention.varlen_api_attention_forward)

    def layer(q, k, v):
        out, _ = forward(None, q, k, v, None, scaling=0.5)
        return torch.tanh(out) * 2

    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    for lengths in LAYOUTS:
        n = sum(lengths)
        # 4 heads beside the first layout's 4 segment bounds: duck sizing would tie the two and recompile at the next
        q, k, v = (torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        with packed_attention(model, impl, cu, max(lengths)):
            got = compiled(q, k, v)
            want = layer(q, k, v)
            grads = torch.autograd.grad(got.sum(), (q, k, v))
        assert torch.allclose(got, want, atol=1e-6)
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
        separate = sdpa_per_segment(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, 0.5)
        assert torch.allclose(want[0], torch.tanh(separate) * 2, atol=1e-6), "attention crossed a segment"
    breaks = sum(counters["graph_break"].values())
    if kernel == "op":
        assert breaks == 0, dict(counters["graph_break"])
        assert counter.frame_count == 1, counter.frame_count  # one region, compiled once (segment counts unbacked)
    else:
        assert breaks > 0 and counter.frame_count <= 2 * 2
    frames = counter.frame_count
    n = 13
    q, k, v = (torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3))
    with packed_attention(model, impl, torch.tensor([0, 4, 13], dtype=torch.int32), 9):
        compiled(q, k, v)
    assert counter.frame_count == frames, "a new layout recompiled"


def test_dora_reads_plain_weights_without_a_graph_break():
    """peft's DoRA weight read (a torchao type check Dynamo cannot trace) broke every DoRA module of a compiled layer
    into its own region; ``traceable_dora_weights`` returns plain weights directly and leaves quantized ones to peft."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora

    from trainer.modeling.compile import traceable_dora_weights

    assert traceable_dora_weights() and traceable_dora_weights()  # idempotent
    assert getattr(dora.dequantize_module_weight, "plain_weights_first", False)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "1"], use_dora=True))
    layer = model.base_model.model[0]
    assert dora.dequantize_module_weight(layer.base_layer) is layer.base_layer.weight

    class Quantized(torch.nn.Module):  # HQQ's shape: W_q plus dequantize()
        W_q = torch.zeros(1)
        weight = torch.nn.Parameter(torch.zeros(2, 2))

        def dequantize(self):
            return torch.ones(2, 2)

    assert torch.equal(dora.dequantize_module_weight(Quantized()), torch.ones(2, 2)), "quantized weights go to peft"
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=True)
    counters.clear()
    x = torch.randn(3, 8)
    assert torch.allclose(compiled(x), model(x), atol=1e-6)
    assert not counters["graph_break"] and counter.frame_count == 1, dict(counters["graph_break"])
