"""What a benchmark run measured (``trainer.bench.measure``) beside TRL's side: our ``training_step``, optimizer step
and step-to-step wall time from the metrics rows, TRL's from ``trl_peer``'s callback clock, the ratio on wall time,
MFU per timed step, and ``recompiles_after_first_step``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.bench import measure as scale
from trainer.bench import trl_peer
from trainer.telemetry import StepClock, step_clock_callback

QUICK = scale.Work(size="tiny", batch=2, image_size=64, max_new_tokens=8)


def _row(step_s: float, optimizer_s: float, wall_s: float, **extra: float) -> dict[str, float]:
    phases = {"time/weight_sync_s": 0.1 * step_s, "time/rollout_s": 0.6 * step_s, "time/target_s": 0.05 * step_s,
              "time/forward_s": 0.1 * step_s, "time/backward_s": 0.15 * step_s}
    return {"phase": "stage2", "loss": 1.0, "time/step_s": step_s, "time/optimizer_s": optimizer_s,
            "time/step_wall_s": wall_s, "time/generate_s": 0.5 * step_s, "batch/tokens": 1000.0, **phases, **extra}


def test_summary_reports_the_optimizer_and_the_wall_beside_the_training_step_and_skips_the_first_step():
    run = QUICK
    rows = [_row(50.0, 9.0, 70.0), _row(10.0, 1.0, 12.0), _row(12.0, 3.0, 16.0)]  # the first: warm-up, left out
    out = scale.summarise_steps(run, rows, checkpointing=True)
    assert out["steps"] == 3
    assert out["step_s"] == pytest.approx(11.0) and out["optimizer_s"] == pytest.approx(2.0)
    assert out["step_wall_s"] == pytest.approx(14.0)
    assert out["per_step"]["time/optimizer_s"] == pytest.approx(2.0)
    assert out["per_step"]["time/step_wall_s"] == pytest.approx(14.0)
    # split: shares of training_step (the optimizer is not in it); wall_split: shares of the wall, optimizer apart
    assert list(out["split"]) == list(scale.TRAINING_STEP_PHASES) and "optimizer" not in out["split"]
    assert sum(out["split"].values()) == pytest.approx(1.0)
    wall = out["wall_split"]
    assert list(wall) == [*scale.TRAINING_STEP_PHASES, "optimizer", "other"]
    assert wall["optimizer"] == pytest.approx(2.0 / 14.0) and wall["other"] == pytest.approx(1.0 / 14.0)
    assert sum(wall.values()) == pytest.approx(1.0)
    assert wall["backward"] == pytest.approx(0.15 * 11.0 / 14.0)
    fb_s = 0.25 * 11.0
    assert out["train_tokens_per_s"] == pytest.approx(1000.0 / fb_s), "fwd + bwd only: the optimizer is not in it"


def test_metrics_from_before_the_optimizer_phase_give_none_not_zero():
    rows = [{k: v for k, v in _row(10.0, 0.0, 0.0).items() if k not in ("time/optimizer_s", "time/step_wall_s")}]
    out = scale.summarise_steps(QUICK, rows, checkpointing=False)
    assert out["step_s"] == pytest.approx(10.0)
    assert out["optimizer_s"] is None and out["step_wall_s"] is None and out["wall_split"] == {}


def _trl(step_s: float = 12.0, wall_s: float | None = 15.0, optimizer_s: float | None = 2.5) -> dict:
    trl = {"step_s": step_s, "blocks_s": {"GRPOTrainerSubclass.vLLM.generate": 8.0,
                                          "GRPOTrainerSubclass.sync_weights": 0.3,
                                          "GRPOTrainerSubclass._prepare_inputs": 9.0}}
    if wall_s is not None:
        trl["step_wall_s"] = wall_s
    if optimizer_s is not None:
        trl["optimizer_s"] = optimizer_s
    return trl


def test_trl_ratio_is_on_step_to_step_wall_time_and_keeps_the_training_step_ratio_apart():
    ours = scale.summarise_steps(QUICK, [_row(10.0, 2.0, 13.0), _row(10.0, 2.0, 12.0)], True)
    r = scale.trl_over_ours(_trl(), ours)
    assert set(r) == {"step_wall", "training_step", "generate", "weight_sync", "train_fwd_bwd", "optimizer",
                      "train_tokens", "train_fwd_bwd_per_token", "step_wall_range"}
    assert r["step_wall_range"] is None, "a TRL JSON without its per-step walls"
    assert "train_fwd_bwd_opt" not in r and "step" not in r
    assert r["step_wall"] == pytest.approx(15.0 / 12.0)
    assert r["training_step"] == pytest.approx(12.0 / 10.0)
    assert r["optimizer"] == pytest.approx(2.5 / 2.0)
    assert r["generate"] == pytest.approx(8.0 / 5.0) and r["weight_sync"] == pytest.approx(0.3 / 1.0)
    # TRL's training_step less _prepare_inputs (generation, sync, rewards) against our forward + backward
    assert r["train_fwd_bwd"] == pytest.approx((12.0 - 9.0) / 2.5)
    assert r["train_tokens"] is None and r["train_fwd_bwd_per_token"] is None  # a TRL JSON without its token count


def test_trl_ratio_is_published_with_the_spread_of_the_steps_behind_it():
    """The H100 4B pairing of 2026-11-28: 1.297 on the means, from our steps 11.70 / 10.57 s and TRL's 14.28 / 14.60 s."""
    ours = scale.summarise_steps(QUICK, [_row(10.0, 1.0, 30.0), _row(10.0, 1.0, 11.70), _row(9.0, 1.0, 10.57)],
                                 True)
    trl = {**_trl(wall_s=(14.28 + 14.60) / 2), "step_wall_s_runs": [40.0, 14.28, 14.60]}
    r = scale.trl_over_ours(trl, ours)
    assert r["step_wall"] == pytest.approx(14.44 / 11.135)
    lo, hi = r["step_wall_range"]
    assert lo == pytest.approx(14.28 / 11.70) and hi == pytest.approx(14.60 / 10.57), \
        "each side's warm-up step (ours 30 s, TRL's 40 s) stays out of the range as it stays out of the means"
    assert lo < r["step_wall"] < hi


def test_trl_ratio_per_token_divides_each_side_by_its_own_tokens():
    ours = scale.summarise_steps(QUICK, [_row(10.0, 2.0, 13.0), _row(10.0, 2.0, 12.0)], True)
    r = scale.trl_over_ours({**_trl(), "train_tokens": 800.0}, ours)  # ours: 1000 tokens in 2.5 s of fwd + bwd
    assert r["train_tokens"] == pytest.approx(0.8)
    # TRL: 3.0 s for 800 tokens, ours 2.5 s for 1000: TRL spends 1.5x our seconds per token
    assert r["train_fwd_bwd_per_token"] == pytest.approx((3.0 / 800.0) / (2.5 / 1000.0))


def test_trl_ratio_without_wall_times_on_either_side_is_none():
    ours = scale.summarise_steps(QUICK, [_row(10.0, 2.0, 12.0)], True)
    old_trl = _trl(wall_s=None, optimizer_s=None)  # a TRL JSON written before trl_peer timed the wall
    r = scale.trl_over_ours(old_trl, ours)
    assert r["step_wall"] is None and r["optimizer"] is None and r["training_step"] == pytest.approx(1.2)
    old_ours = {**ours, "step_wall_s": None, "optimizer_s": None}
    r = scale.trl_over_ours(_trl(), old_ours)
    assert r["step_wall"] is None and r["optimizer"] is None


class _FakeClock:
    def __init__(self, times: list[float]):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


def test_trl_step_clock_times_the_optimizer_and_the_wall_from_train_begin():
    # train_begin 0; step 1: training_step ends 5, step ends 6; step 2: micro-batches end 8 and 10, step ends 10.5;
    # step 3: no training_step end seen (the clock still ticks the wall), ends 14
    clock = StepClock(_FakeClock([0.0, 5.0, 6.0, 8.0, 10.0, 10.5, 14.0]))
    clock.train_begin()
    clock.training_step_end()
    clock.step_end()
    clock.training_step_end()
    clock.training_step_end()  # the last micro-batch's end is the optimizer's start
    clock.step_end()
    clock.step_end()
    assert clock.step_wall_s == pytest.approx([6.0, 4.5, 3.5])
    assert clock.optimizer_s == pytest.approx([1.0, 0.5])


def test_trl_step_clock_runs_as_a_trainer_callback():
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    clock = StepClock(_FakeClock([1.0, 3.0, 3.25, 7.0, 7.5]))
    peaks: list[int] = []
    cb = step_clock_callback(clock, lambda *_: peaks.append(len(clock.step_wall_s)))
    assert isinstance(cb, TrainerCallback)
    cb.on_train_begin(None, None, None)
    clock.training_step_end()
    cb.on_step_end(None, None, None)
    clock.training_step_end()
    cb.on_step_end(None, None, None)
    assert clock.step_wall_s == pytest.approx([2.25, 4.25]) and clock.optimizer_s == pytest.approx([0.25, 0.5])
    assert peaks == [1, 2], "the after-step hook runs once per step, after the clock ticked"


def test_trl_steady_mean_leaves_out_the_first_step():
    assert trl_peer.steady_mean([9.0, 2.0, 4.0]) == pytest.approx(3.0)
    assert trl_peer.steady_mean([5.0]) == 5.0 and trl_peer.steady_mean([]) == 0.0


def test_each_timed_step_keeps_its_own_mfu_so_the_spread_behind_the_mean_is_in_the_record():
    run = scale.Work(size="4b", batch=8, image_size=1024, max_new_tokens=1536, profile_step=4)
    rows = [_row(50.0, 1.0, 60.0), _row(10.0, 1.0, 12.0, **{"batch/tokens": 32000.0, "batch/rows_per_step": 2.0}),
            _row(8.0, 1.0, 9.0, **{"batch/tokens": 16000.0, "batch/rows_per_step": 1.0}), _row(30.0, 1.0, 31.0)]
    out = scale.summarise_steps(run, rows, checkpointing=True, peak_tflops=989.0)
    steps = out["timed_steps"]
    assert [t["step"] for t in steps] == [2, 3], "warm-up step 1 and profiled step 4 are not timed"
    assert [t["rows"] for t in steps] == [2.0, 1.0] and steps[0]["fwd_bwd_s"] == pytest.approx(2.5)
    for t in steps:
        flops = scale.fwd_bwd_flops("4b", t["tokens"], run.batch, (run.image_size // 16) ** 2, checkpointing=True)
        assert t["mfu"] == pytest.approx(flops["model"] / t["fwd_bwd_s"] / 1e12 / 989.0)
    assert min(t["mfu"] for t in steps) <= out["mfu"] <= max(t["mfu"] for t in steps)
    assert steps[0]["mfu"] != pytest.approx(steps[1]["mfu"])
    assert scale.summarise_steps(QUICK, rows[:2], True)["timed_steps"][0]["mfu"] is None
    unknown = scale.summarise_steps(run, rows, checkpointing=True, peak_tflops=None)
    assert unknown["mfu"] is None and unknown["timed_steps"][0]["mfu"] is None, \
        "a card without a known peak gets no MFU rather than the H100's"
    half = scale.summarise_steps(run, rows, checkpointing=True, peak_tflops=989.0 / 2)
    assert half["mfu"] == pytest.approx(2 * out["mfu"]) and half["peak_tflops"] == 989.0 / 2


def test_the_mfu_peak_is_the_card_s_own():
    from trainer.bench.models import peak_bf16_tflops

    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0 == peak_bf16_tflops("NVIDIA H200")
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.5, "the PCIe card's lower peak, not its family's"
    assert peak_bf16_tflops("NVIDIA H100 NVL") == peak_bf16_tflops("NVIDIA H200 NVL") == 835.5
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("NVIDIA L4") is None and peak_bf16_tflops("cpu") is None


def test_trl_side_runs_with_liger_on_the_variant_s_records_lengths_and_vllm_share():
    from trainer.bench.runner import trl_peer_args, work_of

    cfg = {"training": {"max_steps": 3, "per_device_train_batch_size": 8},
           "tuner": {"train_type": "lora", "lora_rank": 64}, "data": {"synthetic": {"image_size": 1024}},
           "custom": {"extra": {"rollout_matching": {"decoding": {"max_new_tokens": 1536},
                                                     "vllm": {"gpu_memory_utilization": 0.35}}}}}
    work = work_of("8b", cfg, 1)
    assert (work.batch, work.lora_rank, work.max_new_tokens, work.image_size) == (8, 64, 1536, 1024)
    args = trl_peer_args(cfg, work, Path("m"), Path("d"), Path("o"))
    assert args[:2] == ["-m", "trainer.bench.trl_peer"] and args[-1] == "--liger"
    assert [args[args.index(k) + 1] for k in ("--steps", "--batch", "--max-new-tokens", "--vllm-util", "--lora-rank")] \
        == ["3", "8", "1536", "0.35", "64"]
    full = work_of("2b", {**cfg, "tuner": None}, 1)
    assert full.tuner == "full" and full.lora_rank == 0


def test_recompiles_after_first_step_is_the_last_logged_value_and_none_when_never_logged():
    rows = [_row(10.0, 1.0, 12.0), _row(10.0, 1.0, 12.0, **{"compile/recompiles_after_first_step": 0.0}),
            _row(10.0, 1.0, 12.0, **{"compile/recompiles_after_first_step": 3.0})]
    assert scale.recompiles_after_first_step(rows) == 3.0, "cumulative and summed over the ranks by the trainer"
    assert scale.recompiles_after_first_step(rows[:2]) == 0.0
    assert scale.recompiles_after_first_step(rows[:1]) is None, "never logged: unknown, not 0"
