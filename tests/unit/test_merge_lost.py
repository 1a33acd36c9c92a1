"""``sync/merge_lost_fraction``: the share of an adapter update's non-zero elements that a merge into bf16 engine
weights rounds away, on layers whose answer is known (all of it, half of it, none of it) for LoRA and DoRA, and
logged by a stage-2 step that syncs merged weights."""

from __future__ import annotations

import pytest
import torch

from trainer.sync.weights import full_weights, merge_lost_fraction


class _One(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False, dtype=dtype)
        torch.nn.init.ones_(self.proj.weight)

    def forward(self, x):
        return self.proj(x)


def _adapted(dtype=torch.bfloat16, use_dora=False):
    """A 4×4 layer of ones (row norm 2) with a rank-1 adapter of scaling 1 (``A`` ones, ``B`` zero)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_One(dtype), LoraConfig(r=1, lora_alpha=1, target_modules=["proj"], use_dora=use_dora))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(1.0)
        layer.lora_B["default"].weight.zero_()
    return model, layer


def _set_b(layer, column):
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(torch.tensor(column).view(4, 1))


def test_lora_updates_below_and_above_half_a_bf16_step():
    model, layer = _adapted()
    assert merge_lost_fraction(model) is None, "B starts at zero: no update yet"
    _set_b(layer, [1e-4] * 4)  # 1 + 1e-4 rounds to 1 in bf16 (its step at 1 is 2**-7)
    assert merge_lost_fraction(model) == 1.0
    _set_b(layer, [1e-4, 1e-4, 0.5, 0.5])  # 1.5 is a bf16 number
    assert merge_lost_fraction(model) == 0.5
    _set_b(layer, [0.5] * 4)
    assert merge_lost_fraction(model) == 0.0
    _set_b(layer, [1e-4] * 4)
    assert merge_lost_fraction(model, torch.float32) == 0.0, "a float32 engine keeps the whole update"
    merged = full_weights(model, torch.bfloat16)["proj.weight"]
    assert torch.equal(merged, torch.ones(4, 4, dtype=torch.bfloat16)), "what the engine gets: the update is gone"


def test_dora_magnitude_updates_below_and_above_half_a_bf16_step():
    model, layer = _adapted(torch.float32, use_dora=True)
    magnitude = layer.lora_magnitude_vector["default"].weight
    assert torch.equal(magnitude, torch.full((4,), 2.0))
    assert merge_lost_fraction(model) is None, "m = ‖W‖ and B = 0: the merged weight is W"
    with torch.no_grad():
        magnitude.fill_(2.0 * (1 + 1e-4))  # every weight scaled by 1 + 1e-4: below half a bf16 step
    assert merge_lost_fraction(model) == 1.0
    with torch.no_grad():
        magnitude.copy_(torch.tensor([2.0 * (1 + 1e-4), 2.0 * (1 + 1e-4), 4.0, 4.0]))  # rows 2, 3 double
    assert merge_lost_fraction(model) == 0.5
    with torch.no_grad():
        magnitude.fill_(4.0)
    assert merge_lost_fraction(model) == 0.0
    assert torch.equal(full_weights(model, torch.bfloat16)["proj.weight"], torch.full((4, 4), 2.0, dtype=torch.bfloat16))


class _Bf16Engine:
    """A weight-sync target standing for a vLLM engine with bf16 weights that serves no adapters."""

    syncs_on_every_rank = True
    engine_dtype = torch.bfloat16

    def __init__(self):
        self.fractions: list[float | None] = []

    def supports_adapter_sync(self):
        return False

    def begin_sync(self): ...

    def end_sync(self): ...

    def sync_full(self, model, merge_adapter=True):
        self.fractions.append(merge_lost_fraction(model, self.engine_dtype))


def test_a_step_that_syncs_merged_weights_logs_the_fraction(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import TrainingArguments

    from trainer.data.records import load_jsonl
    from trainer.data.synthetic import generate
    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import build_tiny_model, tiny_tokenizer
    from trainer.modeling.prompts import PromptEncoder
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.rollout.types import DecodingParams
    from trainer.sft.settings import RolloutSettings, TrainerSettings
    from trainer.sft.stage2 import Stage2Pipeline
    from trainer.sft.trainer import RolloutMatchingTrainer, SampleDataset
    from trainer.sync.policy import WeightSync

    tok = tiny_tokenizer()
    model = get_peft_model(build_tiny_model("text", seed=0)[0], LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 2e-4)  # an early update: mostly below half a bf16 step
    target = _Bf16Engine()
    sync = WeightSync.for_model(target, model, "auto")
    assert sync.decision.mode == "full"
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
                             remove_unused_columns=False, disable_tqdm=True, use_cpu=True)
    trainer = RolloutMatchingTrainer(
        model=model, args=args, train_dataset=SampleDataset(load_jsonl(generate(tmp_path / "data", 4, seed=0))),
        pipeline=Stage2Pipeline(PromptEncoder(tok)),
        engine=HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 2),
        settings=TrainerSettings(rollout=RolloutSettings(DecodingParams(max_new_tokens=8))), weight_sync=sync,
        processing_class=tok)
    trainer.train()
    logged = [r["sync/merge_lost_fraction"] for r in trainer.state.log_history if "sync/merge_lost_fraction" in r]
    assert len(target.fractions) == 2 and target.fractions[0] > 0.5
    assert logged == pytest.approx(target.fractions, rel=1e-6)
