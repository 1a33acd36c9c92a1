"""``training.use_liger_kernel`` on the CPU: the key, the error without the extra, and Liger's entry points called on
the instance with RoPE / RMSNorm / SwiGLU on and its loss kernels off (a fake ``liger_kernel.transformers`` module
records the calls; the real kernels need Triton and a GPU: tests/gpu/test_liger_gpu.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from trainer.config.schema import TrainingConfig
from trainer.extras import MissingExtraError
from trainer.modeling import liger
from trainer.modeling.fixtures import build_tiny_model


def test_the_key_defaults_off_and_the_extra_is_declared():
    from pathlib import Path

    import tomllib

    assert TrainingConfig().use_liger_kernel is False and TrainingConfig(use_liger_kernel=True).use_liger_kernel
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["liger"] == ["liger-kernel==0.8.5"]
    assert not any("liger" in r for r in extras["test"]), "Triton-only: never in the CPU test extras"


def test_without_the_package_the_error_names_the_key_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as on a machine without it
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    model, _ = build_tiny_model("vl")
    with pytest.raises(MissingExtraError) as exc:
        liger.apply_liger_kernel(model)
    msg = str(exc.value)
    assert "training.use_liger_kernel" in msg and "pip install 'rollout-matching[liger]'" in msg
    assert "'liger'" in msg, msg


class FakeSwiGLU:
    """Stands in for ``LigerSwiGLUMLP``: the same maths in torch, so a patched model still runs on the CPU."""

    calls = 0

    def forward(self, x):
        FakeSwiGLU.calls += 1
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.fixture
def fake_liger(monkeypatch):
    calls: list[tuple[str, dict]] = []
    mod = types.ModuleType("liger_kernel.transformers")
    mod.apply_liger_kernel_to_qwen3_vl = lambda **kw: calls.append(("apply_liger_kernel_to_qwen3_vl", kw))
    mod.apply_liger_kernel_to_qwen3 = lambda **kw: calls.append(("apply_liger_kernel_to_qwen3", kw))
    mod.LigerSwiGLUMLP = FakeSwiGLU
    pkg = types.ModuleType("liger_kernel")
    pkg.transformers = mod
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    FakeSwiGLU.calls = 0
    return calls


def test_qwen3_vl_gets_rope_and_rmsnorm_from_liger_and_its_mlps_liger_swiglu(fake_liger):
    model, tok = build_tiny_model("vl")
    ids = torch.randint(0, len(tok), (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    applied = liger.apply_liger_kernel(model)
    (name, kwargs), = fake_liger
    assert name == "apply_liger_kernel_to_qwen3_vl"
    assert kwargs == {"rope": True, "rms_norm": True, "swiglu": False, "cross_entropy": False,
                      "fused_linear_cross_entropy": False, "model": model}, \
        "0.8.5's qwen3_vl entry point ignores swiglu: the MLPs are bound here; the loss kernels stay off"
    assert applied["swiglu_mlps"] == 2 and applied["swiglu"] and applied["loss_kernels"] is False
    layers = model.model.language_model.layers
    assert all(layer.mlp.forward.__func__ is FakeSwiGLU.forward for layer in layers)
    assert not any(getattr(b.mlp.forward, "__func__", None) is FakeSwiGLU.forward for b in model.model.visual.blocks)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert FakeSwiGLU.calls == 2, "each text layer's MLP ran through Liger's forward"
    torch.testing.assert_close(after, before)  # the same SwiGLU maths; parameter names untouched
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in build_tiny_model("vl")[0].named_parameters()}


def test_qwen3_gets_all_three_from_its_entry_point(fake_liger):
    model, _ = build_tiny_model("text")
    applied = liger.apply_liger_kernel(model)
    (name, kwargs), = fake_liger
    assert name == "apply_liger_kernel_to_qwen3" and kwargs == {
        "rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False,
        "model": model}
    assert applied["swiglu_mlps"] == 2


def test_a_lora_model_is_patched_through_its_base(fake_liger):
    from trainer.config.schema import TunerConfig
    from trainer.modeling.loading import apply_tuner

    model, _ = build_tiny_model("vl")
    lora = apply_tuner(model, TunerConfig(train_type="lora", lora_rank=2), multimodal=True)
    liger.apply_liger_kernel(lora)
    (_, kwargs), = fake_liger
    assert kwargs["model"] is model, "Liger's entry points take the transformers model, not the peft wrapper"
    mlp = model.model.language_model.layers[0].mlp
    assert type(mlp.gate_proj).__module__.startswith("peft"), "the LoRA layers stay inside the fused MLP"


def test_other_model_types_are_refused_with_the_key(fake_liger):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(ValueError, match="training.use_liger_kernel: Liger is wired for qwen3, qwen3_vl models"):
        liger.apply_liger_kernel(model)
    assert fake_liger == []


def test_liger_with_compiled_decoder_layers_is_refused_naming_both_keys():
    """Measured on an H100 (2026-11-27): Dynamo cannot trace Liger's RMSNorm inside a compiled decoder layer; the
    config says so at load instead of failing at the first forward after minutes of set-up."""
    import pytest

    from trainer.config.schema import TrainingConfig

    with pytest.raises(ValueError, match="use_liger_kernel and compile_decoder_layers do not combine") as info:
        TrainingConfig(output_dir="o", use_liger_kernel=True, compile_decoder_layers=True)
    assert "set one of them false" in str(info.value)
    assert TrainingConfig(output_dir="o", use_liger_kernel=True).use_liger_kernel
    assert TrainingConfig(output_dir="o", compile_decoder_layers=True).compile_decoder_layers
