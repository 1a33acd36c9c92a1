"""The FLOP count behind every published MFU (``trainer.bench.measure.fwd_bwd_flops`` over the published Qwen3-VL
shapes of ``trainer.bench.models``) and the weight sync's breakdown. The runner's whole path on the CPU is
``tests/unit/test_bench_runner.py::test_the_cpu_table_runs_end_to_end``."""

from __future__ import annotations

import pytest

from trainer.bench import measure as scale
from trainer.bench import models


def test_flops_count_grows_with_size_and_the_published_shapes_have_their_sizes():
    counts = {s: models.param_counts(s)["total"] for s in ("2b", "4b", "8b")}
    assert 1.9e9 < counts["2b"] < 2.4e9 and 4.0e9 < counts["4b"] < 4.8e9 and 8.0e9 < counts["8b"] < 9.2e9, counts
    f = [scale.fwd_bwd_flops(s, 20_000, 8, 4096)["model"] for s in ("2b", "4b", "8b")]
    assert f[0] < f[1] < f[2]
    blocks = models.param_counts("8b")["text_blocks"]
    assert scale.fwd_bwd_flops("8b", 20_000, 8, 4096)["model"] > 6 * blocks * 20_000


def test_the_lm_head_counts_its_logit_rows_trained_or_frozen():
    """The head's matmuls over the rows the objective projects: 6 per head parameter and row when it trains (full),
    4 when frozen (LoRA); the chunked objective's recompute of each projection is in ``hardware`` only; without
    rows the count is the blocks' alone (``model_blocks``, every record before 2026-11-28)."""
    t, rows = 20_000, 12_000
    head_params = models.VOCAB * models.QWEN3_VL_TEXT["8b"]["hidden_size"]
    plain = scale.fwd_bwd_flops("8b", t, 8, 4096)
    for tuner, rank, per in (("full", 0, 6), ("lora", 64, 4)):
        without = scale.fwd_bwd_flops("8b", t, 8, 4096, tuner, rank)
        counted = scale.fwd_bwd_flops("8b", t, 8, 4096, tuner, rank, logit_rows=rows)
        assert counted["lm_head"] == per * head_params * rows
        assert counted["model"] - without["model"] == pytest.approx(per * head_params * rows)
        assert counted["hardware"] - without["hardware"] == pytest.approx((per + 2) * head_params * rows)
        assert counted["model_blocks"] == without["model"] == without["model_blocks"]
    assert plain["lm_head"] == 0 and plain["model"] == plain["model_blocks"]


def test_logit_rows_are_the_supervised_ce_rows_and_coord_slots():
    assert scale.logit_rows({"tokens/ce": 8410.0, "tokens/coord": 1344.0, "batch/tokens": 16336.0}) == 9754.0
    assert scale.logit_rows({"batch/tokens": 100.0}) == 0.0


def _projections(size: str) -> list[tuple[int, int]]:
    """(in, out) of one language-model block's q, k, v, o, gate, up, down projections, from the published shape."""
    t = models.QWEN3_VL_TEXT[size]
    h, inter = t["hidden_size"], t["intermediate_size"]
    dq, dkv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    return [(h, dq), (h, dkv), (h, dkv), (dq, h), (h, inter), (h, inter), (inter, h)]


@pytest.mark.parametrize("tuner", ["lora", "dora"])
def test_an_adapter_run_counts_its_frozen_base_at_4_and_its_adapter_at_6_flops_per_parameter_token(tuner):
    t, layers = 16_000, models.QWEN3_VL_TEXT["8b"]["num_hidden_layers"]
    weights = layers * sum(i * o for i, o in _projections("8b"))
    adapter = layers * 64 * sum(i + o for i, o in _projections("8b"))
    full = scale.fwd_bwd_flops("8b", t, 8, 4096)
    lora = scale.fwd_bwd_flops("8b", t, 8, 4096, tuner, 64)
    blocks = full["trained_params"]
    assert abs(blocks - weights) < 1e-3 * weights, "the blocks are their projections (plus norm weights)"
    assert lora["trained_params"] == adapter and lora["frozen_block_params"] == blocks
    attention_and_vision = full["model"] - 6 * blocks * t
    assert lora["model"] == pytest.approx(4 * blocks * t + 6 * adapter * t + attention_and_vision, rel=1e-12)
    assert 0.70 < lora["model"] / full["model"] < 0.75, "6 per frozen parameter-token overstated 8B LoRA MFU by ~1.38x"


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_hfu_adds_one_forward_of_every_block_when_checkpointing(tuner):
    t, samples = 16_000, 8
    text = models.QWEN3_VL_TEXT["8b"]
    plain = scale.fwd_bwd_flops("8b", t, samples, 4096, tuner, 64)
    ckpt = scale.fwd_bwd_flops("8b", t, samples, 4096, tuner, 64, checkpointing=True)
    assert plain["hardware"] == plain["model"] == ckpt["model"], "model FLOPs do not depend on the recompute"
    attention_forward = 2 * text["num_hidden_layers"] * text["num_attention_heads"] * text["head_dim"] * t * t / samples
    recompute = 2 * (ckpt["trained_params"] + ckpt["frozen_block_params"]) * t + attention_forward
    assert ckpt["hardware"] - ckpt["model"] == pytest.approx(recompute, rel=1e-12)


def test_flops_refuse_an_unknown_tuner_or_an_adapter_without_rank():
    with pytest.raises(ValueError, match="tuner 'ia3'"):
        scale.fwd_bwd_flops("tiny", 100, 1, 16, "ia3")
    with pytest.raises(ValueError, match="lora_rank > 0"):
        scale.fwd_bwd_flops("tiny", 100, 1, 16, "lora", 0)


def test_the_sync_breakdown_accounts_for_the_whole_sync_and_adds_sleep_and_wake():
    avg = {"time/weight_sync_s": 0.30, "time/sync_learner_check_s": 0.01, "time/sync_collect_s": 0.12,
           "time/sync_check_s": 0.02, "time/sync_wake_s": 0.05, "time/sync_check_wait_s": 0.01,
           "time/sync_load_s": 0.06, "time/sleep_s": 0.04, "time/wake_s": 0.03, "time/generate_s": 9.0}
    out = scale.sync_breakdown(avg)
    parts = out["sync_parts_s"]
    assert list(parts) == [*scale.SYNC_PARTS, "unaccounted"]
    assert abs(sum(parts.values()) - 0.30) < 1e-9 and abs(parts["unaccounted"] - 0.03) < 1e-9
    without_overlap = scale.sync_breakdown({k: v for k, v in avg.items() if k != "time/sync_check_wait_s"})
    assert "sync_check_wait" not in without_overlap["sync_parts_s"], "a sync without overlap_wake reads no wait"
    assert abs(out["sleep_wake_sync_s"] - 0.37) < 1e-9
    no_sleep = scale.sync_breakdown({k: v for k, v in avg.items() if k not in ("time/sleep_s", "time/wake_s")})
    assert "sleep_wake_sync_s" not in no_sleep
    assert scale.sync_breakdown({"time/generate_s": 1.0}) == {}, "the HF backend has no sync to break down"
