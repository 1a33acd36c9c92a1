"""``training.compile_activation_memory_budget``: the compiled decoder layers keep less for their backward and give
the same gradients, and ``auto``'s compiled estimate is what a compiled layer keeps.

Counted with saved-tensor hooks around one compiled Qwen3-VL text layer (float32, the op's CPU kernel, a packed row
of three segments); parameters and the layer's inputs are not activations and are left out. The layer is compiled
by ``compile_decoder_layers`` (which sets the budget), then recompiled with the partitioning backend alone."""

from __future__ import annotations

import pytest
import torch

from tests.compiled_layer import one_layer
from trainer.config.schema import TrainingConfig
from trainer.modeling import checkpointing as ck
from trainer.modeling.compile import compile_decoder_layers
from trainer.packing.varlen_attention import packed_attention

L = 96
H, INTER, HEADS, KV, D = 128, 384, 4, 2, 32


def _layer_and_inputs():
    return one_layer(H, INTER, HEADS, KV, D, [6, 5, 5], L)


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


FOUR_B = ck.TextShape(36, 2560, 4096, 1024, 9728, 151936)


def test_auto_with_compiled_layers_uses_the_compiled_estimate():
    """At 4B, 16k tokens, 30 GiB left: eager off needs ~109 GiB, compiled ~60, compiled at budget 0.4 ~26: only the
    last runs without checkpointing."""
    plans = [ck.MemoryPlan(FOUR_B, 16384, 2, 80 * ck.GIB, 42 * ck.GIB, compiled_budgets=b) for b in ((), (1.0,), (0.4,))]
    assert plans[0].budget_bytes / ck.GIB == pytest.approx(30.0)
    choices = [ck.choose_checkpointing(p) for p in plans]
    assert [c.estimates_gib[ck._with_budget("off", b)] for c, b in zip(choices, (None, 1.0, 0.4))] == pytest.approx(
        [109.1, 60.2, 25.8], abs=0.1)
    assert [c.label for c in choices] == ["full", "full", "off@0.4"]
    assert [c.memory_budget for c in choices] == [None, 1.0, 0.4]


@pytest.mark.parametrize(("left_gib", "label"), [(70, "off"), (40, "off@0.6"), (35, "off@0.5"), (27, "off@0.4"),
                                                   (21, "off@0.3"), (12, "full")])
def test_auto_budget_takes_the_largest_that_fits_before_any_checkpointing(left_gib, label):
    """``compile_activation_memory_budget: auto``: no checkpointing at 1, 0.6, 0.5, 0.4, 0.3 (estimates at 4B, 16k:
    60.2, 37.2, 31.5, 25.8, 20.0 GiB), then the selective spacings and full at budget 1 (selective/4 needs ~46 GiB at
    budget 1: never before an off that fits)."""
    plan = ck.MemoryPlan(FOUR_B, 16384, 2, 80 * ck.GIB, (72 - left_gib) * ck.GIB, compiled_budgets=ck.AUTO_MEMORY_BUDGETS)
    choice = ck.choose_checkpointing(plan)
    assert [round(choice.estimates_gib[k], 1) for k in ("off", "off@0.6", "off@0.5", "off@0.4", "off@0.3")] == [
        60.2, 37.2, 31.5, 25.8, 20.0]
    assert choice.label == label
    assert choice.memory_budget == (1.0 if label in ("off", "full") else float(label.split("@")[1]))
    if label == "full":  # every selective spacing at budget 1 needs more than off at 0.3
        assert min(v for k, v in choice.estimates_gib.items() if k.startswith("selective")) > 20.0


def test_auto_budget_is_resolved_into_the_config_and_the_setup_row(tmp_path):
    """The resolved config carries the chosen budget (what ``run.py`` compiles with) and the setup row says both the
    budget that runs and the one requested."""
    import json

    from trainer.config.schema import validate_config
    from trainer.modeling.fixtures import build_tiny_model
    from trainer.modeling.levers import apply_model_levers

    cfg = validate_config({"model": {"tiny": "vl"}, "data": {"synthetic": {"num_samples": 4}},
                           "training": {"output_dir": str(tmp_path), "compile_decoder_layers": True,
                                        "gradient_checkpointing_policy": "auto", "packing": True,
                                        "packing_length": 4096, "compile_activation_memory_budget": "auto"},
                           "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}})
    model, _ = build_tiny_model("vl")
    roomy, row = apply_model_levers(cfg, model, tmp_path, device_bytes=64 * ck.GIB)
    assert (roomy.training.checkpointing_policy, roomy.training.compile_activation_memory_budget) == ("off", 1.0)
    setup = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert setup["train/compile_activation_memory_budget"] == 1.0
    assert setup["train/compile_activation_memory_budget_requested"] == "auto"
    plan = ck.memory_plan(cfg, model, device=64 * ck.GIB)
    need = {b: ck.activation_bytes(plan.shape, plan.tokens, plan.dtype_bytes, 0, b) for b in (0.5, 0.4)}
    device = (plan.resident_bytes + plan.loss_bytes + (need[0.5] + need[0.4]) / 2) / (1 - ck.HEADROOM)
    squeezed, row = apply_model_levers(cfg, model, None, device_bytes=device)
    assert (squeezed.training.checkpointing_policy, squeezed.training.compile_activation_memory_budget) == ("off", 0.4)
    assert row["train/compile_activation_memory_budget"] == 0.4 and row["train/checkpointing_policy"] == "off"
    assert cfg.training.compile_activation_memory_budget == "auto", "the caller's config is left as it was"


def test_the_budget_needs_compiled_layers_that_are_not_all_checkpointed():
    with pytest.raises(ValueError, match="needs compile_decoder_layers"):
        TrainingConfig(output_dir="o", compile_activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="no effect with gradient_checkpointing_policy full"):
        TrainingConfig(output_dir="o", compile_decoder_layers=True, gradient_checkpointing=True,
                       compile_activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="compile_activation_memory_budget"):
        TrainingConfig(output_dir="o", compile_decoder_layers=True, compile_activation_memory_budget=0.0)
    with pytest.raises(ValueError, match="auto needs compile_decoder_layers: true and gradient_checkpointing_policy"):
        TrainingConfig(output_dir="o", compile_decoder_layers=True, gradient_checkpointing_policy="off",
                       compile_activation_memory_budget="auto")
    ok = TrainingConfig(output_dir="o", compile_decoder_layers=True, gradient_checkpointing_policy="auto",
                        compile_activation_memory_budget=0.4)
    assert ok.compile_activation_memory_budget == 0.4


EIGHT_B = ck.TextShape(36, 4096, 4096, 1024, 12288, 151936)


@pytest.mark.parametrize(("shape", "resident_gib", "measured"), [
    (EIGHT_B, 18.94, {"off@0.6": (68.1, 68.4), "off@0.5": (64.5,)}),  # 8B LoRA r64 beside an engine at 0.35
    (FOUR_B, 30.75, {"off@0.6": (73.0,), "off@0.4": (64.7,)}),  # 4B full beside an engine at 0.2
])
def test_the_compiled_estimate_and_the_measured_device_use_at_level_2(shape, resident_gib, measured):
    """The runs of 2026-11-28 on an H100 (79.19 GiB; sleep level 2, 16k rows, no checkpointing): the driver's used memory of
    each run against resident + loss + the compiled estimate. The residents are the runs' own (the 2026-11-28 records:
    ``checkpointing_budget_gib`` 50.59 at 8B, 38.78 at 4B). Each measured run fitted with the engine charged nothing
    (asleep, its pool unmapped); the estimate is never above the measurement and at most the 10 % headroom ``auto``
    keeps (7.9 GiB) below it (4B: 3.3-6.5 GiB below), so what ``auto`` chooses fits. The 2026-11-28 ``auto`` chose 0.6
    at both sizes, as here."""
    device = 79.19
    plan = ck.MemoryPlan(shape, 16384, 2, device * ck.GIB, resident_gib * ck.GIB, 0.0, 1.74 * ck.GIB,
                         compiled_budgets=ck.AUTO_MEMORY_BUDGETS)
    choice = ck.choose_checkpointing(plan)
    for label, runs in measured.items():
        estimate = resident_gib + 1.74 + choice.estimates_gib[label]
        for used_gib in runs:
            assert 0 <= used_gib - estimate <= ck.HEADROOM * device, (label, estimate, used_gib)
    assert choice.label == "off@0.6"
    assert abs(choice.budget_gib - (50.59 if shape is EIGHT_B else 38.78)) < 0.05, "the runs' own budgets"
