"""GPU-only: ``training.compile_activation_memory_budget`` through Inductor on CUDA. One Qwen3-VL-4B-shaped text
layer (bf16, the packed varlen op), compiled by ``compile_decoder_layers`` at budget 1 and at 0.4: the forward's
memory kept for the backward falls by what the CPU counts (``tests/unit/test_compile_memory_budget.py``: at most
0.45 of budget 1's), the gradients stay those of budget 1, and the forward + backward time of both is printed.

Run: ``python -m pytest -m gpu -s tests/gpu/test_memory_budget_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from tests.compiled_layer import one_layer
from trainer.modeling.compile import compile_decoder_layers
from trainer.packing.varlen_attention import packed_attention
from trainer.packing.varlen_kernel import flash_kernels_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flash_kernels_available(), reason="needs CUDA + torch flash attention")]

L = 8192


def _run(budget: float):
    torch._dynamo.reset()
    model, x, (cos, sin) = one_layer(2560, 9728, 32, 8, 128, [24, 20, 20], L, "cuda", torch.bfloat16)
    compile_decoder_layers(model, budget)
    cu = torch.tensor([0, 1500, 4000, 6100, L], dtype=torch.int32, device="cuda")
    weight = torch.linspace(-1, 1, 2560, device="cuda", dtype=torch.bfloat16)

    def step():
        with packed_attention(model, model.config._attn_implementation, cu, 2500):
            out = model.layers[0](x, position_embeddings=(cos, sin), attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            kept = torch.cuda.memory_allocated() - before
            grads = torch.autograd.grad((out * weight).float().sum(), (x, *model.parameters()))
        return kept, grads

    before = torch.cuda.memory_allocated()
    step()  # compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kept, grads = step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    return kept, [g.float() for g in grads], start.elapsed_time(end) / 5


def test_budget_keeps_less_on_cuda_with_the_same_gradients():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    try:
        (full, g_full, t_full), (low, g_low, t_low) = _run(1.0), _run(0.4)
    finally:
        functorch_config.activation_memory_budget = before
        torch._dynamo.reset()
    print(f"\n4B layer, {L} tokens: kept for the backward {full / 2**20:.0f} MiB at budget 1, {low / 2**20:.0f} MiB "
          f"at 0.4 ({low / full:.2f}); forward + backward {t_full:.2f} ms vs {t_low:.2f} ms ({t_low / t_full:.2f}x)")
    assert low <= 0.5 * full, (low, full)
    for a, b in zip(g_full, g_low):
        assert float((a - b).norm() / b.norm().clamp_min(1e-12)) < 2e-2
