"""`bench --only scale --quick`: the Qwen3-VL scale bench's whole code path (random VL model directory, synthetic
1024-style records, one stage-2 step through run_training, per-phase split, JSON + PNG) on the tiny Qwen3-VL on the
CPU, so the GPU bench cannot rot between GPU sessions."""

from __future__ import annotations

import json

import pytest

from trainer.bench import scale


def test_scale_quick_records_the_step_from_its_raw_timers(tmp_path, monkeypatch):
    monkeypatch.setenv("RM_BENCH_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("RM_BENCH_SCALE_PROFILE", "1")
    result = scale.run(tmp_path / "out", quick=True)
    saved = json.loads((tmp_path / "out" / "scale_quick.json").read_text())
    assert saved == json.loads(json.dumps(result))
    (rec,) = saved["runs"]
    assert rec["name"] == "tiny-full-sleep2-util0.3" and "error" not in rec, rec
    rows = [json.loads(line) for line in (tmp_path / "work" / "runs" / rec["name"] / "metrics.jsonl").open()]
    (raw,) = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]  # the step's own timers
    assert rec["steps"] == 1 and rec["step_s"] == raw["time/step_s"] > 0
    for phase in ("rollout", "target", "forward", "backward"):
        assert raw[f"time/{phase}_s"] > 0, phase
        assert rec["split"][phase] * rec["step_s"] == pytest.approx(raw[f"time/{phase}_s"], rel=1e-9), phase
    assert "time/weight_sync_s" not in raw and rec["split"]["weight_sync"] == 0.0, "the HF backend syncs nothing"
    # the optimizer step (after training_step, outside step_s) and the step-to-step wall, as the trainer logged them
    assert rec["optimizer_s"] == raw["time/optimizer_s"] > 0 and "optimizer" not in rec["split"]
    assert rec["step_wall_s"] == raw["time/step_wall_s"] >= rec["step_s"] + rec["optimizer_s"] - 1e-6
    assert sum(rec["wall_split"].values()) == pytest.approx(1.0, rel=1e-9)
    assert rec["wall_split"]["optimizer"] * rec["step_wall_s"] == pytest.approx(raw["time/optimizer_s"], rel=1e-9)
    tokens, fb_s = raw["batch/tokens"], raw["time/forward_s"] + raw["time/backward_s"]
    assert tokens > 0 and rec["train_tokens_per_s"] == pytest.approx(tokens / fb_s, rel=1e-9)
    assert rec["rollout_tokens_per_s"] == pytest.approx(2 * 8 / raw["time/generate_s"], rel=1e-9)
    rows_projected = raw["tokens/ce"] + raw["tokens/coord"]
    assert 0 < rows_projected < tokens, "the LM head projects the supervised rows, not every token"
    flops = scale.fwd_bwd_flops("tiny", tokens, 2, (64 // 16) ** 2, "full", checkpointing=True,
                                logit_rows=rows_projected)
    assert rec["flops"] == pytest.approx(flops) and rec["flops"]["hardware"] > rec["flops"]["model"] > 0
    assert rec["flops"]["logit_rows"] == rows_projected and rec["flops"]["lm_head"] > 0
    assert rec["fwd_bwd_tflops"] == pytest.approx(flops["model"] / fb_s / 1e12, rel=1e-9)
    assert rec["mfu"] is None and rec["hfu"] is None and rec["mfu_blocks"] is None, "no MFU against an H100 peak on the CPU"
    assert rec["flop_count"] == scale.FLOP_COUNT
    assert (tmp_path / "out" / "scale_quick.png").stat().st_size > 10_000
    # RM_BENCH_SCALE_PROFILE=1: step 1's forward + backward under torch.profiler (operators on the CPU)
    prof = rec["profile"]
    assert prof["step"] == 1 and prof["device"] == "cpu" and prof["by_category_s"].get("matmul", 0) > 0, prof


def test_flops_count_grows_with_size_and_the_published_shapes_have_their_sizes():
    counts = {s: scale.param_counts(s)["total"] for s in ("2b", "4b", "8b")}
    assert 1.9e9 < counts["2b"] < 2.4e9 and 4.0e9 < counts["4b"] < 4.8e9 and 8.0e9 < counts["8b"] < 9.2e9, counts
    f = [scale.fwd_bwd_flops(s, 20_000, 8, 4096)["model"] for s in ("2b", "4b", "8b")]
    assert f[0] < f[1] < f[2]
    blocks = scale.param_counts("8b")["text_blocks"]
    assert scale.fwd_bwd_flops("8b", 20_000, 8, 4096)["model"] > 6 * blocks * 20_000


def test_the_lm_head_counts_its_logit_rows_trained_or_frozen():
    """The head's matmuls over the rows the objective projects: 6 per head parameter and row when it trains (full),
    4 when frozen (LoRA); the chunked objective's recompute of each projection is in ``hardware`` only; without
    rows the count is the blocks' alone (``model_blocks``, every record before session 26)."""
    t, rows = 20_000, 12_000
    head_params = scale.VOCAB * scale.QWEN3_VL_TEXT["8b"]["hidden_size"]
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
    t = scale.QWEN3_VL_TEXT[size]
    h, inter = t["hidden_size"], t["intermediate_size"]
    dq, dkv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    return [(h, dq), (h, dkv), (h, dkv), (dq, h), (h, inter), (h, inter), (inter, h)]


@pytest.mark.parametrize("tuner", ["lora", "dora"])
def test_an_adapter_run_counts_its_frozen_base_at_4_and_its_adapter_at_6_flops_per_parameter_token(tuner):
    t, layers = 16_000, scale.QWEN3_VL_TEXT["8b"]["num_hidden_layers"]
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
    text = scale.QWEN3_VL_TEXT["8b"]
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


def test_utilisations_multiply_the_selected_runs_and_bad_values_are_refused():
    import pytest

    runs = scale.selected("2b,8b-lora64-sleep2-util0.35")
    assert [r.name for r in runs] == ["2b-full-sleep2-util0.3", "8b-lora64-sleep2-util0.35"]
    assert scale.with_utilisations(runs, None) == runs
    names = [r.name for r in scale.with_utilisations(runs, "0.25, 0.45")]
    assert names == ["2b-full-sleep2-util0.25", "2b-full-sleep2-util0.45", "8b-lora64-sleep2-util0.25",
                     "8b-lora64-sleep2-util0.45"]
    for bad in ("0.3,1.2", "half", ","):
        with pytest.raises(SystemExit, match="RM_BENCH_SCALE_UTILS"):
            scale.with_utilisations(runs, bad)


def test_logit_chunk_and_merge_knobs_name_the_run_and_reach_its_config(tmp_path):
    import dataclasses

    import pytest

    from trainer.config.schema import validate_config

    run = scale.selected("8b-lora64-sleep2-util0.35")[0]
    assert scale.logit_and_merge_knobs(None, None) == {}
    for chunk, merge, suffix, rows in (("none", "float32", "-allrows-mergef32", None), ("256", None, "-chunk256", 256),
                                       ("1024", "weight_dtype", "", 1024)):
        varied = dataclasses.replace(run, **scale.logit_and_merge_knobs(chunk, merge))
        assert varied.name == run.name + suffix
        cfg = validate_config(scale.stage2_config(varied, tmp_path / "model", tmp_path / "out", "vllm"))
        rm = cfg.custom.extra.rollout_matching
        assert rm.loss.logit_chunk_rows == rows and rm.vllm.sync.merge_precision == (merge or "weight_dtype")
    adapter = dataclasses.replace(run, vllm_lora=True)
    sync = validate_config(scale.stage2_config(adapter, tmp_path / "m", tmp_path / "o", "vllm")).custom.extra \
        .rollout_matching.vllm.sync
    assert sync.mode == "adapter" and sync.merge_precision == "weight_dtype"
    for chunk, merge in (("0", None), ("half", None), (None, "fp8")):
        with pytest.raises(SystemExit, match="RM_BENCH_SCALE_"):
            scale.logit_and_merge_knobs(chunk, merge)


def test_a_configuration_that_runs_out_of_memory_is_recorded_with_its_phase_and_advice(tmp_path, monkeypatch):
    import torch

    from trainer.sft import trainer as trainer_module

    def forward_that_runs_out(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(trainer_module, "forward_loss", forward_that_runs_out)
    rec = scale.run_one(scale.QUICK, tmp_path / "work", "cpu")
    assert rec["oom_phase"] == "forward" and "ran out of GPU memory in forward" in rec["error"], rec.get("error")
    assert rec["advice"] and rec["advice"][0].startswith("training.packing_length (now "), rec["advice"]
