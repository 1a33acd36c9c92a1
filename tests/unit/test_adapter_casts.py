"""peft's float32 input cast is a pure copy under bf16 autocast: turning it off inside the training forward +
backward keeps the loss and the adapter gradients bit-identical, removes the casts, and is undone afterwards (so
HF generation outside autocast still gets peft's cast)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.config.schema import TunerConfig
from trainer.modeling.adapter_casts import adapter_layers, uncast_adapter_inputs
from trainer.modeling.fixtures import build_tiny_model
from trainer.modeling.loading import apply_tuner
from trainer.sft import trainer as trainer_module


def bf16_lora(train_type: str = "lora", dropout: float = 0.0):
    model, _ = build_tiny_model("text", seed=0)
    model = apply_tuner(model.to(torch.bfloat16), TunerConfig(train_type=train_type, lora_rank=8,
                                                              lora_dropout=dropout), multimodal=False)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # peft starts B at zero; non-zero so the adapter path shows
    return model


def loss_grads_and_casts(model, ids, uncast: bool):
    model.zero_grad()
    layers = adapter_layers(model)
    ctx = uncast_adapter_inputs(layers) if uncast else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                               lambda t: t)
    with torch.profiler.profile() as prof, ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return loss.detach(), grads, casts


def test_uncast_inputs_are_bit_identical_under_autocast_and_copy_less():
    model = bf16_lora()
    layers = adapter_layers(model)
    assert layers and all(m.lora_A["default"].weight.dtype == torch.float32 for m in layers)
    ids = torch.randint(0, 200, (2, 48))
    loss_a, grads_a, casts_a = loss_grads_and_casts(model, ids, uncast=False)
    loss_b, grads_b, casts_b = loss_grads_and_casts(model, ids, uncast=True)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    assert casts_b < casts_a, (casts_a, casts_b)
    assert all(getattr(m, "cast_input_dtype_enabled", True) for m in layers), "flags not restored"


def test_dora_and_dropout_layers_keep_peft_s_cast():
    """DoRA computes with the float32 input outside autocast's matmuls, so uncasting would change its numbers."""
    assert adapter_layers(bf16_lora("dora")) == []
    assert adapter_layers(bf16_lora("lora", dropout=0.1)) == []
    model, _ = build_tiny_model("text", seed=0)
    assert adapter_layers(model) == []


def test_flags_are_restored_when_the_region_raises():
    model = bf16_lora()
    layers = adapter_layers(model)
    with pytest.raises(RuntimeError, match="boom"), uncast_adapter_inputs(layers):
        assert not any(m.cast_input_dtype_enabled for m in layers)
        raise RuntimeError("boom")
    assert all(m.cast_input_dtype_enabled for m in layers)


@pytest.mark.parametrize("bf16", [True, False])
def test_the_trainer_uncasts_only_inside_a_mixed_precision_training_step(tmp_path, monkeypatch, bf16):
    model = bf16_lora() if bf16 else apply_tuner(build_tiny_model("text", seed=0)[0],
                                                 TunerConfig(train_type="lora", lora_rank=8), multimodal=False)
    seen: list[list[bool]] = []
    original = trainer_module.forward_loss

    def spy(model_, *args, **kwargs):
        seen.append([getattr(m, "cast_input_dtype_enabled", True) for m in adapter_layers(model_)])
        return original(model_, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "forward_loss", spy)
    trainer = tiny_stage2_trainer(tmp_path, model=model, bf16=bf16)
    assert trainer.accelerator.native_amp is bf16
    trainer.train()
    assert seen and all(flags for flags in seen)
    assert all(not any(f) for f in seen) if bf16 else all(all(f) for f in seen), seen
    assert all(m.cast_input_dtype_enabled for m in adapter_layers(model)), "flags not restored after the step"
