"""``training.compile_activation_memory_budget``: the compiled decoder layers keep less for their backward and give
the same gradients, and ``auto``'s compiled estimate is what a compiled layer keeps.

Counted with saved-tensor hooks around one compiled Qwen3-VL text layer (float32, the op's CPU kernel, a packed row
of three segments); parameters and the layer's inputs are not activations and are left out. The layer is compiled
by ``compile_decoder_layers`` (which sets the budget), then recompiled with the partitioning backend alone."""

from __future__ import annotations

import pytest
import torch

from trainer.config.schema import TrainingConfig
from trainer.modeling import checkpointing as ck
from trainer.modeling.compile import compile_decoder_layers
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention

L = 96
H, INTER, HEADS, KV, D = 128, 384, 4, 2, 32


class OneLayer(torch.nn.Module):
    """A text model of one Qwen3-VL decoder layer, shaped the way ``decoder_layers`` finds it."""

    def __init__(self, config):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer

        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList([Qwen3VLTextDecoderLayer(config, 0)])

    def get_decoder(self):
        return self


def _layer_and_inputs():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = Qwen3VLTextConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
                            num_key_value_heads=KV, head_dim=D, vocab_size=64,
                            rope_scaling={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True})
    cfg._attn_implementation = register_varlen_attention("op")
    torch.manual_seed(0)
    model = OneLayer(cfg)
    x = torch.randn(1, L, H, requires_grad=True)
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(x, torch.arange(L)[None].expand(3, 1, L))
    return model, x, (cos, sin)


def _saved_bytes_and_grads(budget: float):
    """Compiled through AOTAutograd's min-cut partitioner (the one Inductor runs, where the budget acts) without
    Inductor's code generation, which only costs time here."""
    torch._dynamo.reset()
    model, x, rope = _layer_and_inputs()
    compile_decoder_layers(model, budget)
    for layer in model.layers:
        layer.compile(dynamic=True, backend="aot_eager_decomp_partition")
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), x, *rope)}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    cu = torch.tensor([0, 40, 70, L], dtype=torch.int32)
    with packed_attention(model, model.config._attn_implementation, cu, 40):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.layers[0](x, position_embeddings=rope, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, H)).sum(), (x, *model.parameters()))
    return sum(storages.values()), grads


@pytest.fixture(scope="module")
def budgets():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    try:
        yield {b: _saved_bytes_and_grads(b) for b in (1.0, 0.4)}
    finally:
        functorch_config.activation_memory_budget = before
        torch._dynamo.reset()


def test_a_lower_budget_keeps_less_and_gives_the_same_gradients(budgets):
    (full, g_full), (low, g_low) = budgets[1.0], budgets[0.4]
    assert low <= 0.45 * full, (low, full)
    for a, b in zip(g_full, g_low):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_the_compiled_estimate_is_what_a_compiled_layer_keeps(budgets):
    """The estimate (``compiled_activation_bytes_per_token_per_layer`` less the layer input it adds) against the
    measured bytes, float32, at budget 1: within 10 % (the partitioner's small fp32 statistics are not counted)."""
    shape = ck.TextShape(1, H, HEADS * D, KV * D, INTER, 64)
    estimate = (ck.compiled_activation_bytes_per_token_per_layer(shape, 4) - 4 * H) * L
    measured = budgets[1.0][0]
    assert 0.9 * measured <= estimate <= 1.1 * measured, (estimate, measured)
    eager = ck.activation_bytes_per_token_per_layer(shape, 4) * L
    assert estimate < 0.7 * eager


def test_auto_with_compiled_layers_uses_the_compiled_estimate():
    """At 4B, 16k tokens: eager off needs ~109 GiB, compiled ~60, compiled at budget 0.4 ~26; a 30 GiB budget takes
    off only for the last."""
    shape = ck.TextShape(36, 2560, 4096, 1024, 9728, 151936)
    eager = ck.MemoryPlan(shape, 16384, 2, 80 * ck.GIB, 42 * ck.GIB)
    assert eager.budget_bytes / ck.GIB == pytest.approx(30.0)
    compiled = ck.MemoryPlan(shape, 16384, 2, 80 * ck.GIB, 42 * ck.GIB, compiled_budget=1.0)
    low = ck.MemoryPlan(shape, 16384, 2, 80 * ck.GIB, 42 * ck.GIB, compiled_budget=0.4)
    choices = [ck.choose_checkpointing(p) for p in (eager, compiled, low)]
    assert [c.estimates_gib["off"] for c in choices] == pytest.approx([109.1, 60.2, 25.8], abs=0.1)
    assert [c.label for c in choices] == ["full", "full", "off"]


def test_the_budget_needs_compiled_layers_that_are_not_all_checkpointed():
    with pytest.raises(ValueError, match="needs compile_decoder_layers"):
        TrainingConfig(output_dir="o", compile_activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="no effect with gradient_checkpointing_policy full"):
        TrainingConfig(output_dir="o", compile_decoder_layers=True, gradient_checkpointing=True,
                       compile_activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="compile_activation_memory_budget"):
        TrainingConfig(output_dir="o", compile_decoder_layers=True, compile_activation_memory_budget=0.0)
    ok = TrainingConfig(output_dir="o", compile_decoder_layers=True, gradient_checkpointing_policy="auto",
                        compile_activation_memory_budget=0.4)
    assert ok.compile_activation_memory_budget == 0.4
