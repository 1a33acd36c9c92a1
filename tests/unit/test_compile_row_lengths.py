"""The compiled decoder layers (``training.compile_decoder_layers``) after the first step: a rank that ran out of
segments trains a short last row and zero-weight filler rows, and neither compiles a new graph.

On 2 x H200 (Qwen3-VL-2B, 8192-token rows) each rank compiled a second graph at its first step with a filler row: its
last real row that step was the leftover segment (fill 0.34, under 4096 tokens), and the graph compiled on full rows
carried Inductor's guard ``4096 <= rows`` from Triton's mix-order reduction. The layers are compiled with
``LENGTH_AGNOSTIC_INDUCTOR`` (checked here as the options Inductor gets; the guard itself is Triton's:
``tests/gpu/test_recompiles_gpu.py`` holds a long then a short row to one graph). The filler rows themselves are
shown here to take the real rows' compiled path and to add no gradient."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import TrainerCallback

from tests.compiled_layer import one_layer
from tests.tiny_trainer import tiny_stage2_trainer
from trainer.modeling import compile as compile_mod
from trainer.modeling.compile import LENGTH_AGNOSTIC_INDUCTOR, compile_decoder_layers, length_agnostic_options
from trainer.modeling.fixtures import build_tiny_model
from trainer.packing.buffer import PackingBuffer
from trainer.packing.varlen_attention import register_varlen_attention
from trainer.sft.settings import LayoutSettings
from trainer.sft.trainer import RolloutMatchingTrainer


def _compile_calls(monkeypatch, backend) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **kw: calls.append(kw))
    model = one_layer(64, 128, 2, 1, 32, [6, 5, 5], 8)[0]
    compile_decoder_layers(model, backend=backend)
    return calls


def test_inductor_compiles_the_layers_with_no_choice_guarded_on_the_row_length(monkeypatch):
    calls = _compile_calls(monkeypatch, "inductor")
    assert len(calls) == 1 and calls[0]["dynamic"] is True
    assert calls[0]["options"] == {"triton.mix_order_reduction_non_strict_mode": True}
    from torch._inductor import config as inductor_config

    with inductor_config.patch(calls[0]["options"]):  # names Inductor knows
        assert inductor_config.triton.mix_order_reduction_non_strict_mode is True


def test_another_backend_gets_no_inductor_options(monkeypatch):
    calls = _compile_calls(monkeypatch, CompileCounterWithBackend("eager"))
    assert len(calls) == 1 and "options" not in calls[0]


def test_an_inductor_without_the_non_strict_switch_turns_the_mix_order_reduction_off():
    assert length_agnostic_options({"triton.mix_order_reduction", "max_autotune"}) == \
        {"triton.mix_order_reduction": False}
    assert length_agnostic_options({"max_autotune"}) == {}
    assert length_agnostic_options() == LENGTH_AGNOSTIC_INDUCTOR  # this torch has the switch


class FinalGradients(TrainerCallback):
    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def test_a_filler_row_after_the_first_step_compiles_nothing_and_adds_no_gradient(tmp_path, monkeypatch):
    """One record a step, one packed row; from the second step on the ranks "agree" on one row more than this rank
    has (``_rows_agreed``), so it trains its row and then a filler row copied from it, with loss weight 0."""
    torch._dynamo.reset()
    counters.clear()
    model = build_tiny_model("text", seed=0)[0]
    model.train()
    counter = CompileCounterWithBackend("aot_eager")
    compile_decoder_layers(model, backend=counter)
    frames: list[tuple[int, float]] = []  # (graphs compiled before the row's forward, its loss weight)
    before_filler: list[dict[str, torch.Tensor]] = []
    original_loss = RolloutMatchingTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        frames.append((counter.frame_count, float(inputs["loss_weight"])))
        if not inputs["loss_weight"]:
            before_filler.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None})
        return original_loss(self, model, inputs, *args, **kwargs)

    def rows_agreed(self, local):
        return local + 1 if self.state.global_step >= 1 else local

    monkeypatch.setattr(RolloutMatchingTrainer, "compute_loss", compute_loss)
    monkeypatch.setattr(RolloutMatchingTrainer, "_rows_agreed", rows_agreed)
    final = FinalGradients()
    trainer = tiny_stage2_trainer(tmp_path, model=model, records=3, max_steps=3, per_device=1,
                                  target_source="ground_truth", packing=PackingBuffer(1024, 64),
                                  layout=LayoutSettings(packed_attn_implementation=register_varlen_attention("op")),
                                  args={"max_grad_norm": 0.0}, callbacks=[final])
    trainer.train()
    assert [w for _, w in frames] == [1.0, 1.0, 0.0, 1.0, 0.0], frames
    assert counter.frame_count >= 1, "the layers ran compiled"
    assert [f for f, _ in frames[1:]] + [counter.frame_count] == [frames[1][0]] * 5, \
        f"graphs compiled before each row of steps 2-3 and after: {frames}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["batch/filler_rows"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["compile/new_graphs"] for r in rows][1:] == [0.0, 0.0]
    # the filler (each step's last backward) leaves the gradients of the step's real row as they were
    assert len(before_filler) == 2 and len(final.grads) == 3
    for before, after in zip(before_filler, final.grads[1:]):
        assert set(before) == set(after) and any(float(g.abs().max()) > 0 for g in after.values())
        for name, grad in after.items():
            assert torch.equal(before[name], grad), f"{name}: the filler row changed the gradient"
    assert compile_mod.compiled_graphs() == counters["stats"]["unique_graphs"]
