"""``training.gradient_checkpointing_policy``: the config keys, the old bool, the TrainingArguments it becomes, which
decoder layers HF then checkpoints, and ``auto``'s pure estimate (``trainer.modeling.checkpointing``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import TrainingArguments

from trainer.config.errors import ConfigErrors
from trainer.config.schema import TrainingConfig, validate_config
from trainer.modeling import checkpointing as ck
from trainer.modeling.compile import decoder_layers
from trainer.modeling.fixtures import build_tiny_model


def stage2(**training) -> dict:
    return {"model": {"tiny": "vl"}, "data": {"synthetic": {"num_samples": 4}},
            "training": {"output_dir": "/tmp/x", **training},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}


@pytest.mark.parametrize("training, policy", [
    ({}, "off"), ({"gradient_checkpointing": True}, "full"), ({"gradient_checkpointing": False}, "off"),
    ({"gradient_checkpointing_policy": "selective"}, "selective"), ({"gradient_checkpointing_policy": "auto"}, "auto"),
    # the policy supersedes the bool (a config extending the template's `gradient_checkpointing: false` sets only it)
    ({"gradient_checkpointing": False, "gradient_checkpointing_policy": "full"}, "full"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_policy": "off"}, "off"),
])
def test_the_policy_and_the_old_bool(training, policy):
    assert validate_config(stage2(**training)).training.checkpointing_policy == policy


@pytest.mark.parametrize("training, fragment", [
    ({"gradient_checkpointing_policy": "some"}, "'full', 'selective', 'off' or 'auto'"),
    ({"gradient_checkpointing_policy": "selective", "gradient_checkpointing_every_n_layers": 1},
     "greater than or equal to 2"),
    ({"gradient_checkpointing_every_n_layers": 3}, "only applies with gradient_checkpointing_policy selective or auto"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_every_n_layers": 3}, "not full"),
])
def test_bad_checkpointing_settings_are_refused_with_the_key(training, fragment):
    with pytest.raises(ConfigErrors) as exc:
        validate_config(stage2(**training))
    (err,) = exc.value.errors
    assert err.key_path.startswith("training") and fragment in err.message, err


FIELDS = TrainingArguments.__dataclass_fields__
KEY = "activation_checkpointing" if "activation_checkpointing" in FIELDS else "gradient_checkpointing"


@pytest.mark.parametrize("training, expected", [
    ({}, {KEY: False}),
    ({"gradient_checkpointing": True}, {KEY: True}),  # unchanged from before the policy existed: no kwargs
    ({"gradient_checkpointing_policy": "full"}, {KEY: True}),
    ({"gradient_checkpointing_policy": "off"}, {KEY: False}),
    ({"gradient_checkpointing_policy": "selective"},
     {KEY: True, f"{KEY}_kwargs": {"use_reentrant": False, "every_n_layers": 2}}),
    ({"gradient_checkpointing_policy": "selective", "gradient_checkpointing_every_n_layers": 3},
     {KEY: True, f"{KEY}_kwargs": {"use_reentrant": False, "every_n_layers": 3}}),
])
def test_training_arguments_carry_the_policy(training, expected):
    t = TrainingConfig(**training)
    assert ck.training_arguments_kwargs(t, FIELDS) == expected
    args = TrainingArguments(output_dir="/tmp/x", use_cpu=True, report_to=[], **expected)
    assert getattr(args, KEY) is expected[KEY]


def test_auto_must_be_resolved_before_the_training_arguments_and_the_rename_is_followed():
    with pytest.raises(ValueError, match="auto is resolved at start-up"):
        ck.training_arguments_kwargs(TrainingConfig(gradient_checkpointing_policy="auto"), FIELDS)
    renamed = {"activation_checkpointing": None}  # transformers 5.2x
    assert ck.training_arguments_kwargs(TrainingConfig(gradient_checkpointing_policy="selective"), renamed) == {
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}}


def _enable_as_the_trainer_does(model, every_n: int) -> list[int]:
    """What HF's Trainer does with ``gradient_checkpointing_kwargs={"every_n_layers": n}``; the flags it leaves."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                        every_n_layers=every_n)
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]


@pytest.mark.parametrize("kind, every_n, expected", [
    ("text", 2, [0]), ("vl", 2, [0]),
    ("vl", 3, [1]),  # HF counts the 2 vision blocks first: blocks 0 and 3 of (v0, v1, t0, t1) -> text layer 1
])
def test_the_predicted_layers_are_the_ones_hf_checkpoints(kind, every_n, expected):
    model, _ = build_tiny_model(kind)
    predicted = ck.checkpointed_decoder_layers(model, "selective", every_n)
    assert predicted == expected == _enable_as_the_trainer_does(model, every_n)
    assert ck.checkpointed_decoder_layers(model, "full") == [0, 1]
    assert ck.checkpointed_decoder_layers(model, "off") == []


def test_the_predicted_layers_hold_through_a_lora_wrapper():
    from trainer.config.schema import TunerConfig
    from trainer.modeling.loading import apply_tuner

    model, _ = build_tiny_model("vl")
    lora = apply_tuner(model, TunerConfig(train_type="lora", lora_rank=2), multimodal=True)
    assert ck.checkpointed_decoder_layers(lora, "selective", 3) == [1] == _enable_as_the_trainer_does(lora, 3)


def test_selective_checkpointing_trains_to_the_same_gradients_as_none():
    """Recomputing a layer in the backward changes no gradient (float32, CPU)."""
    model, tok = build_tiny_model("text", seed=1)
    model.train()
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    assert _enable_as_the_trainer_does(model, 2) == [0]
    selective = grads()
    assert plain.keys() == selective.keys()
    for name, g in plain.items():
        torch.testing.assert_close(selective[name], g, rtol=1e-5, atol=1e-6, msg=name)


# ---- auto: the pure estimate --------------------------------------------------------------------------------------

QWEN3_VL_2B = ck.TextShape(layers=28, hidden=2048, q_dim=2048, kv_dim=1024, intermediate=6144, vocab=151936)
GIB = 2**30


def test_the_activation_count_per_token_per_layer():
    # 8 h + 8 q + 7 kv + 4 i elements, 2 bytes each in bf16
    assert ck.activation_bytes_per_token_per_layer(QWEN3_VL_2B, 2) == 2 * (8 * 2048 + 8 * 2048 + 7 * 1024 + 4 * 6144)
    per_layer = ck.activation_bytes_per_token_per_layer(QWEN3_VL_2B, 2) * 1000
    assert ck.activation_bytes(QWEN3_VL_2B, 1000, 2, 0) == 28 * per_layer
    # full: every layer's input (h a token), plus one layer rebuilt at a time in the backward
    assert ck.activation_bytes(QWEN3_VL_2B, 1000, 2, 28) == 28 * 2048 * 2 * 1000 + per_layer
    # selective every 2: 14 layers keep everything, 14 keep their input, one is rebuilt
    assert ck.checkpointed_count(28, "selective", 2) == 14 and ck.checkpointed_count(27, "selective", 2) == 14
    assert ck.activation_bytes(QWEN3_VL_2B, 1000, 2, 14) == 14 * per_layer + 14 * 2048 * 2 * 1000 + per_layer
    with pytest.raises(ValueError, match="resolve auto first"):
        ck.checkpointed_count(28, "auto")


def plan(device_gib: float, resident_gib: float = 14.0, tokens: int = 16384, **kw) -> ck.MemoryPlan:
    return ck.MemoryPlan(QWEN3_VL_2B, tokens, 2, device_gib * GIB, resident_gib * GIB, **kw)


def test_auto_is_off_where_it_fits_selective_where_it_almost_does_full_where_needed():
    off, sel4, sel2, full = (ck.activation_bytes(QWEN3_VL_2B, 16384, 2, c) / GIB for c in (0, 7, 14, 28))
    assert off > sel4 > sel2 > full

    def device_for(activation_gib):  # the device that leaves exactly this much after 10 % headroom and 14 GiB
        return (activation_gib + 14.0) / 0.9

    choice = ck.choose_checkpointing(plan(device_for(off) + 1))
    assert (choice.policy, choice.every_n_layers, choice.requested) == ("off", None, "auto")
    assert choice.estimates_gib["off"] == pytest.approx(off) and choice.budget_gib >= off
    choice = ck.choose_checkpointing(plan(device_for(off) - 1))
    assert (choice.policy, choice.every_n_layers, choice.label) == ("selective", 4, "selective/4")
    assert "off would need" in choice.reason
    choice = ck.choose_checkpointing(plan(device_for(sel2) + 0.1))
    assert (choice.policy, choice.every_n_layers) == ("selective", 2)
    choice = ck.choose_checkpointing(plan(device_for(sel2) - 0.1))
    assert choice.policy == "full" and choice.every_n_layers is None
    choice = ck.choose_checkpointing(plan(device_for(full) - 1))
    assert choice.policy == "full" and "nothing fits" in choice.reason
    assert set(choice.estimates_gib) == {"off", "selective/4", "selective/3", "selective/2", "full"}
    # a fixed spacing: only it is tried between off and full
    assert ck.choose_checkpointing(plan(device_for(sel4) + 0.1), (2,)).every_n_layers == 2


def test_the_budget_subtracts_headroom_weights_engine_and_loss():
    p = plan(80.0, resident_gib=20.0, engine_bytes=5 * GIB, loss_bytes=3 * GIB)
    assert p.budget_bytes / GIB == pytest.approx(80 * 0.9 - 20 - 5 - 3)
    # an 80 GB H100, Qwen3-VL-2B full fine-tune at 16k packed tokens (~13.6 GiB weights + gradients + AdamW, 1024
    # logit rows) beside a colocated engine at 0.3 (the 2026-11-26 run): every 2nd layer is checkpointed. Charging the
    # sleeping engine 2 GiB chose every 4th, which then could not wake the engine's KV cache on the H100 (before the cache
    # release before each wake; since 2026-11-28 a level-1/2 engine is charged nothing: memory_plan).
    h100 = plan(79.2, resident_gib=13.6, engine_bytes=0.3 * 79.2 * GIB, loss_bytes=1.74 * GIB)
    assert (ck.choose_checkpointing(h100).policy, ck.choose_checkpointing(h100).every_n_layers) == ("selective", 2)
    asleep_as_2gib = plan(79.2, resident_gib=13.6, engine_bytes=2 * GIB, loss_bytes=1.74 * GIB)
    assert ck.choose_checkpointing(asleep_as_2gib).every_n_layers == 4, "the old charge (what failed on the H100)"


def test_the_estimated_peak_is_the_committed_memory_plus_the_chosen_activations():
    choice = ck.choose_checkpointing(plan(80.0, resident_gib=20.0, engine_bytes=5 * GIB, loss_bytes=3 * GIB))
    assert choice.committed_gib == pytest.approx(28.0)
    assert choice.estimated_peak_gib == pytest.approx(28.0 + choice.estimates_gib[choice.label])
    assert choice.estimated_peak_gib <= 80 * 0.9, "a policy that fits stays under the device less the headroom"
    assert ck.CheckpointingChoice("full").estimated_peak_gib is None, "an explicit policy has no estimate"


def test_resident_bytes_count_weights_gradients_and_adamw_states_and_zero_shards_them():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10, bias=False), torch.nn.Linear(10, 10, bias=False))
    model[1].weight.requires_grad_(False)
    w = 100 * 4  # one 10x10 float32 weight
    assert ck.resident_bytes(model) == 2 * w + w + 2 * w  # both weights, one gradient, AdamW's two states
    # ZeRO-2: a gradient cut by an edge of the rank's partition is held whole (two edges for a middle rank)
    assert ck.resident_bytes(model, "zero2", world_size=4) == 2 * w + w / 4 + 2 * w + 12 * 100 / 4
    assert ck.resident_bytes(model, "zero2", world_size=2) == 2 * w + w / 2 + w + 12 * 100 / 2
    assert ck.resident_bytes(model, "zero2", world_size=1) == 2 * w + w + 12 * 100, "one rank: no edge"
    assert ck.resident_bytes(model, "zero2_offload", world_size=4) == 2 * w + w / 4
    assert ck.resident_bytes(model, "zero3", world_size=4) == 2 * w / 4 + w / 4 + 12 * 100 / 4
    assert ck.resident_bytes(model, "zero3_offload", world_size=4) == w / 4
    assert ck.resident_bytes(model, "/path/ds.json") == ck.resident_bytes(model)
    assert ck.resident_bytes(model, "zero1", world_size=4) == 2 * w + w + 12 * 100 / 4, "stage 1: states only"
    assert ck.resident_bytes(model, "zero1", world_size=1) == 2 * w + w + 12 * 100, "one rank: nothing to shard"


def test_ddp_on_several_ranks_holds_its_gradient_buckets_beside_the_gradients():
    """Several ranks without ZeRO: DDP's all-reduce buckets are one gradient copy more (the rows of a step accumulate
    into fresh gradients beside them: HF's zero_grad sets them to None); one rank has no DDP."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10, bias=False), torch.nn.Linear(10, 10, bias=False))
    model[1].weight.requires_grad_(False)
    w = 100 * 4
    assert ck.resident_bytes(model, world_size=2) == 2 * w + 2 * w + 2 * w
    assert ck.resident_bytes(model, world_size=8) == ck.resident_bytes(model, world_size=2)
    assert ck.resident_bytes(model, world_size=1) == 2 * w + w + 2 * w


def test_the_trainer_wraps_ddp_with_gradients_as_bucket_views(tmp_path):
    """What the DDP wrapper gets (accelerate's handler, read when the model is prepared): the gradients are views of
    the all-reduce buckets, so no separate copy stays after a step's all-reduce."""
    from tests.tiny_trainer import tiny_stage2_trainer

    trainer = tiny_stage2_trainer(tmp_path)
    assert trainer.accelerator.ddp_handler.to_kwargs().get("gradient_as_bucket_view") is True


def test_resolve_reads_the_config_and_the_model(tmp_path):
    model, _ = build_tiny_model("vl")
    cfg = validate_config(stage2(gradient_checkpointing_policy="auto", packing=True, packing_length=4096))
    p = ck.memory_plan(cfg, model, device=8 * GIB)
    assert p.shape == ck.TextShape(2, 128, 128, 128, 384, model.config.get_text_config().vocab_size)
    assert p.tokens == 4096 and p.dtype_bytes == 4 and p.engine_bytes == 0  # float32 tiny model, HF backend
    assert p.loss_bytes == 3 * 4 * 1024 * p.shape.vocab  # logit_chunk_rows 1024
    assert ck.resolve_checkpointing(cfg, model, device=8 * GIB).policy == "off"  # a tiny model fits anywhere
    assert ck.resolve_checkpointing(cfg, model, device=0.0).policy == "full"
    sel = validate_config(stage2(gradient_checkpointing_policy="selective", gradient_checkpointing_every_n_layers=3))
    assert dataclasses.astuple(ck.resolve_checkpointing(sel, model))[:3] == ("selective", 3, "selective")
    resolved = ck.resolved_config(cfg, ck.resolve_checkpointing(cfg, model, device=0.0)).training
    assert (resolved.checkpointing_policy, resolved.gradient_checkpointing) == ("full", True)
    assert cfg.training.checkpointing_policy == "auto", "the caller's config is left as it was"


def test_a_colocated_engine_is_charged_what_stays_mapped_while_the_learner_trains():
    """Level 0 keeps the engine's whole pool mapped while the learner trains: charged the share. ``kv_cache`` frees the
    KV cache and keeps the weights: charged its copy of the weights (half precision under ``vllm.dtype: auto``, split
    over its tensor-parallel ranks). Levels 1 and 2 unmap it, and the cache release before each wake maps it back:
    charged nothing (H100: the engine woke in every step beside learners that used 64-68 GiB of the card)."""
    model, _ = build_tiny_model("vl")
    weights = sum(p.numel() for p in model.parameters())
    rm = {"rollout_backend": "vllm", "vllm": {"max_model_len": 2048, "sleep_level": 0,
                                              "gpu_memory_utilization": 0.4}}
    data = stage2(gradient_checkpointing_policy="auto", per_device_train_batch_size=2)
    data["custom"]["extra"]["rollout_matching"] = rm
    p = ck.memory_plan(validate_config(data), model, device=80 * GIB)
    assert p.engine_bytes == pytest.approx(0.4 * 80 * GIB) and p.tokens == 2 * 2048  # batch x max_model_len
    for level, charged in ((0, 0.4 * 80 * GIB), ("kv_cache", 2.0 * weights), (1, 0.0), (2, 0.0)):
        rm["vllm"]["sleep_level"] = level
        assert ck.memory_plan(validate_config(data), model, device=80 * GIB).engine_bytes == pytest.approx(charged), level
    rm["vllm"].update(sleep_level="kv_cache", dtype="float32", tensor_parallel_size=2)
    assert ck.memory_plan(validate_config(data), model, device=80 * GIB).engine_bytes == pytest.approx(2.0 * weights)


def test_the_engines_weights_leave_the_adapters_out():
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model("text")
    base = ck.engine_weight_bytes(model, "bfloat16")
    assert base == 2.0 * sum(p.numel() for p in model.parameters())
    tuned = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert ck.engine_weight_bytes(tuned, "auto") == base
    assert ck.engine_weight_bytes(tuned, "float32", tensor_parallel_size=2) == base


def test_a_plan_on_several_ranks_counts_the_buckets_or_the_zero_shards():
    model, _ = build_tiny_model("vl")
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp = validate_config(stage2(gradient_checkpointing_policy="auto"))
    one = ck.memory_plan(ddp, model, world_size=1, device=80 * GIB).resident_bytes
    assert ck.memory_plan(ddp, model, world_size=2, device=80 * GIB).resident_bytes == one + trained
    zero2 = validate_config(stage2(gradient_checkpointing_policy="auto", deepspeed="zero2"))
    assert ck.memory_plan(zero2, model, world_size=4, device=80 * GIB).resident_bytes < one


def test_the_oom_advice_names_the_same_default_spacing():
    from trainer.memory.oom import SELECTIVE_EVERY_N

    assert SELECTIVE_EVERY_N == ck.DEFAULT_EVERY_N
