"""``training.compile_decoder_layers`` with packed rows: the varlen attention is kept out of the compiled graph, so
a new segment layout (new ``max_len`` and segment count in the side channel, every step) does not recompile the
layers. On the H100 the compiled 2B Qwen3-VL recompiled at every step (forward 6.4-6.7 s vs 0.30 s eager). The CUDA
kernel is replaced here by a per-segment causal SDPA with the same signature."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

from trainer.modeling.fixtures import build_tiny_model
from trainer.packing import varlen_attention
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    assert window_size == (-1, 0) and max_q == max(torch.diff(cu_q).tolist())
    bounds = cu_q.tolist()
    out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                          scale=scale).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out)


def test_new_segment_layouts_do_not_recompile(monkeypatch):
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", reference_varlen)
    model, _ = build_tiny_model("vl", seed=0)
    impl = register_varlen_attention()

    def layer(q, k, v):
        out, _ = varlen_attention.varlen_attention_forward(None, q, k, v, None, scaling=0.5)
        return torch.tanh(out) * 2

    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    torch._dynamo.reset()
    for lengths in ([5, 7, 4], [9, 3], [2, 2, 2, 10], [6, 6, 6, 6, 1]):
        n = sum(lengths)
        q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        with packed_attention(model, impl, cu, max(lengths)):
            got = compiled(q, k, v)
            want = layer(q, k, v)
        assert torch.allclose(got, want, atol=1e-6)
        separate = torch.cat([reference_varlen(*(t[0].transpose(0, 1)[a:b] for t in (q, k, v)),
                                               torch.tensor([0, b - a]), None, b - a, b - a, scale=0.5,
                                               window_size=(-1, 0))
                              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        assert torch.allclose(want[0], torch.tanh(separate) * 2, atol=1e-6), "attention crossed a segment"
    # the graphs around the attention call: compiled for the first layout, then (dynamic=True) once more at most
    # when the token count turns symbolic; never once per layout
    assert counter.frame_count <= 2 * 2, counter.frame_count
    frames_after_two = counter.frame_count
    n = 13
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    with packed_attention(model, impl, torch.tensor([0, 4, 13], dtype=torch.int32), 9):
        compiled(q, k, v)
    assert counter.frame_count == frames_after_two, "a new layout recompiled"
