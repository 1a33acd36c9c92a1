"""``bench --only layouts``: the layout table, the config each layout gets, the measurement from metrics + every
rank's ledger, and (slow) the CPU quick run end to end through ``trainer serve`` and torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.bench.layouts import LAYOUTS, QUICK_WORK, Layout, Work, compare, layout_config, measure, select
from trainer.config.schema import validate_config


def test_select_fits_the_gpus_and_names_unknown_layouts():
    four = [x.name for x in select(LAYOUTS, 4, None)]
    assert "colocate-4" in four and "3v1-async" in four and "colocate-8" not in four and "6v2-async" not in four
    assert [x.name for x in select(LAYOUTS, 8, "6v2-async,colocate-1")] == ["6v2-async", "colocate-1"], "as named"
    assert [x.name for x in select(LAYOUTS, 4, "6v2-async,colocate-1,colocate-1")] == ["colocate-1"], "fits, once"
    with pytest.raises(ValueError, match="unknown layout"):
        select(LAYOUTS, 4, "5v3")


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.gpus <= 8])
def test_every_layout_config_validates(layout, tmp_path):
    urls = [f"http://127.0.0.1:{8000 + i}" for i in range(layout.servers)]
    cfg = validate_config(layout_config(layout, Work(), tmp_path / "m", tmp_path / "out", urls, cuda=True))
    t = cfg.training
    assert t.records_per_step == (layout.records_per_step or 64)
    assert t.packing and cfg.rollout_matching.rollout_generate_batch_size == t.records_per_step
    v = cfg.rollout_matching.vllm
    assert v.mode == layout.mode
    if layout.servers:
        assert len(v.server.base_urls()) == layout.servers
        assert v.server.async_rollouts.enabled == layout.async_rollouts
    else:
        assert v.tensor_parallel_size == layout.tp
        assert v.sleep_level == ("kv_cache" if layout.name.endswith("-sleepkv") else 2)
    assert v.pixels_during_decode == layout.pixels_during_decode == ("-pixels" in layout.name)
    assert (t.deepspeed == "zero2") == (layout.zero == 2)
    auto_compile = "-auto-compile" in layout.name
    assert t.checkpointing_policy == ("auto" if auto_compile else "full")
    assert t.compile_decoder_layers == auto_compile
    assert v.sync.recorded_load == layout.name.endswith("-recload")
    assert t.compile_activation_memory_budget == ("auto" if auto_compile else 1.0), \
        "the -auto-compile learner is the values files' (auto policy, compiled layers, auto budget)"


def test_cpu_layouts_train_without_checkpointing_or_compile(tmp_path):
    cfg = validate_config(layout_config(Layout("x", 1, checkpointing="auto", compile=False), QUICK_WORK,
                                        tmp_path / "m", tmp_path / "out", [], cuda=False))
    assert cfg.training.checkpointing_policy == "off" and not cfg.training.compile_decoder_layers


def _write_run(run: Path, times: list[float], per_rank: dict[int, list[list[str]]]) -> None:
    (run / "stage2").mkdir(parents=True)
    rows = [{"phase": "stage2", "step": i + 1, "loss": 1.0, "time": t, "time/weight_sync_s": 0.5 + i,
             "batch/rows_per_step": 3.0} for i, t in enumerate(times)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for rank, steps in per_rank.items():
        name = "ledger.jsonl" if rank == 0 else f"ledger.rank{rank}.jsonl"
        lines = [json.dumps({"epoch": 0, "sample_id": sid, "step": step}) for step, ids in enumerate(steps) for sid in ids]
        (run / "stage2" / name).write_text("\n".join(lines) + "\n")


def test_measure_counts_every_rank_after_the_warm_up(tmp_path):
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a", "b"], ["c"], ["d", "e"]], 1: [["f"], ["g", "h"], ["i"]]})
    m = measure(tmp_path)
    assert m["trained_samples"] == 6, "steps 2 and 3 on both ranks; step 1 is warm-up"
    assert m["trained_samples_per_s"] == pytest.approx(6 / 6.0) and m["step_wall_s"] == pytest.approx(3.0)
    assert m["means"]["time/weight_sync_s"] == pytest.approx(2.0), "mean over the measured steps only"
    assert m["ledger"] == {"rows": 9, "duplicated": 0, "carried": 0, "carried_and_trained": 0}


def test_measure_counts_the_carry_of_every_rank(tmp_path):
    """The carry left at the end is every rank's (it was rank 0's logged mean: colocate-4 on the H200s reported 3
    records 'unaccounted' that ranks 1-3 still held)."""
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a"], ["b"], ["c"]], 1: [["d"], ["e"], ["f"]]})
    (tmp_path / "stage2" / "carried.jsonl").write_text(json.dumps({"sample_id": "g", "rollout_step": 2}) + "\n")
    (tmp_path / "stage2" / "carried.rank1.jsonl").write_text(
        "".join(json.dumps({"sample_id": s, "rollout_step": 2}) + "\n" for s in ("h", "c")))
    m = measure(tmp_path)
    assert m["carried_at_end"] == 3
    assert m["ledger"]["carried"] == 3 and m["ledger"]["carried_and_trained"] == 1, "'c' was trained and is carried"


def test_measure_reports_the_checkpointing_that_ran(tmp_path):
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a"], ["b"], ["c"]]})
    rows = (tmp_path / "metrics.jsonl").read_text()
    setup = {"phase": "setup", "step": 0, "time": 99.0, "train/checkpointing_policy": "selective",
             "train/checkpointed_layers": 14, "train/compile_activation_memory_budget": 0.4,
             "train/cpu_threads_per_rank": 16}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(setup) + "\n" + rows)
    m = measure(tmp_path)
    assert m["learner_checkpointing"] == "selective" and m["learner_checkpointed_layers"] == 14
    assert m["learner_memory_budget"] == 0.4 and m["learner_cpu_threads"] == 16
    assert m["steps_measured"] == 2, "the setup row is not a step"


def test_compare_sets_a_faster_learner_against_colocate_1_with_the_same_levers():
    from dataclasses import asdict

    def rec(layout: Layout, sps: float) -> dict:
        return {"name": layout.name, "gpus": layout.gpus, "layout": asdict(layout), "trained_samples_per_s": sps}

    fast = {"checkpointing": "auto", "compile": True}
    recs = [rec(Layout("colocate-1", 1), 2.0),
            rec(Layout("colocate-1-pixels-auto-compile", 1, pixels_during_decode=True, **fast), 4.0),
            rec(Layout("colocate-1-auto-compile", 1, **fast), 2.5),
            rec(Layout("3v1-async-auto-compile", 1, servers=3, async_rollouts=True, **fast), 8.0),
            rec(Layout("3v1-async", 1, servers=3, async_rollouts=True), 5.0)]
    compare(recs)
    assert recs[3]["speedup_vs_colocate_1"] == 4.0 and recs[3]["per_gpu_efficiency"] == 1.0
    assert recs[3]["speedup_vs_same_learner_colocate_1"] == 3.2 and recs[3]["per_gpu_efficiency_same_learner"] == 0.8, \
        "the baseline is colocate-1's placement and work with the same levers, not another one-GPU layout"
    assert "speedup_vs_same_learner_colocate_1" not in recs[4], "default learner: colocate-1 is its baseline already"


def test_an_engine_lever_is_part_of_the_same_levers_baseline():
    from dataclasses import asdict

    def rec(layout: Layout, sps: float) -> dict:
        return {"name": layout.name, "gpus": layout.gpus, "layout": asdict(layout), "trained_samples_per_s": sps}

    fast = {"checkpointing": "auto", "compile": True}
    recs = [rec(Layout("colocate-1-auto-compile", 1, **fast), 3.0),
            rec(Layout("colocate-1-pixels-auto-compile-recload", 1, pixels_during_decode=True, recorded_load=True,
                       **fast), 4.0),
            rec(Layout("colocate-2-r128-pixels-auto-compile-recload", 2, records_per_step=128,
                       pixels_during_decode=True, recorded_load=True, **fast), 7.6),
            rec(Layout("colocate-4-r256-pixels", 4, records_per_step=256, pixels_during_decode=True), 10.0)]
    compare(recs)
    assert recs[2]["speedup_vs_same_learner_colocate_1"] == 1.9 and recs[2]["per_gpu_efficiency_same_learner"] == 0.95, \
        "the pixels and the recorded load are levers: the baseline is the colocate-1 that ran them too"
    assert "speedup_vs_same_learner_colocate_1" not in recs[3], "no colocate-1 ran with pixels alone"
    assert recs[1]["speedup_vs_same_learner_colocate_1"] == 1.0, "a colocate-1 with levers is its own baseline"


def test_merge_calls_tags_each_record_and_compares_across_calls(tmp_path):
    from trainer.bench.layouts import merge_calls

    one = {"work": {"size": "2b"}, "gpus": 4, "layouts": [
        {"name": "colocate-1", "gpus": 1, "layout": {"servers": 0, "tp": 1}, "trained_samples_per_s": 2.0}]}
    two = {"work": {"size": "2b"}, "gpus": 4, "layouts": [
        {"name": "3v1-async", "gpus": 4, "layout": {"servers": 3}, "trained_samples_per_s": 6.0}]}
    paths = []
    for i, res in enumerate((one, two)):
        paths.append(tmp_path / f"call{i}.json")
        paths[-1].write_text(json.dumps(res))
    out = merge_calls(paths, session=23, device="4 x H200")
    assert [r["call"] for r in out["layouts"]] == [1, 2] and out["session"] == 23 and out["work"] == {"size": "2b"}
    assert out["layouts"][1]["speedup_vs_colocate_1"] == 3.0, "the baseline came from call 1"


def test_compare_is_per_gpu_against_colocate_1():
    recs = [{"name": "colocate-1", "gpus": 1, "trained_samples_per_s": 2.0},
            {"name": "3v1-async", "gpus": 4, "trained_samples_per_s": 6.0}, {"name": "x", "gpus": 4, "error": "e"}]
    compare(recs)
    assert recs[1]["speedup_vs_colocate_1"] == 3.0 and recs[1]["per_gpu_efficiency"] == 0.75
    assert "per_gpu_efficiency" not in recs[2]


@pytest.mark.slow
def test_quick_run_on_the_cpu(tmp_path):
    from trainer.bench.layouts import run

    result = run(tmp_path / "out", quick=True, work_dir=tmp_path / "work")
    assert result["work"]["size"] == QUICK_WORK.size
    names = [r["name"] for r in result["layouts"]]
    assert names == ["colocate-1", "colocate-2", "1v1-async", "2v1-async-kill"]
    for r in result["layouts"]:
        assert "error" not in r, (r["name"], r.get("error"), r.get("learner_log_tail", "")[-2000:])
        assert r["trained_samples_per_s"] > 0 and r["ledger"]["duplicated"] == 0
        assert r["ledger"]["rows"] >= QUICK_WORK.records_per_step, "every rank's ledger is read"
        assert r["ledger"]["unaccounted"] == 0 and r["ledger"]["carried_and_trained"] == 0, (r["name"], r["ledger"])
    fault = result["layouts"][-1]["fault"]
    assert fault["killed_after_step"] >= 1 and fault["restarted_after_s"] >= 0, fault
    assert fault["quarantined"], ("the killed server was never quarantined", fault)
    assert (tmp_path / "out" / "layouts_quick.json").is_file() and (tmp_path / "out" / "layouts_quick.png").is_file()
    assert isinstance(Layout("a", 1).gpus, int)


def test_a_failed_layout_keeps_the_head_of_its_learner_log(tmp_path, monkeypatch):
    """vLLM's start-up error is at the top of the learner's log: a failure record carries the head as well as the
    tail (the TP4 failure on the H100s lost it)."""
    from trainer.bench import layouts

    def learner_that_fails(argv, log, gpus):
        log.write_text("ERROR vLLM could not start: the reason\n" + "noise\n" * 5000)
        import subprocess
        import sys

        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(layouts, "_popen", learner_that_fails)
    rec = layouts.run_layout(Layout("colocate-1", 1), QUICK_WORK, tmp_path / "m", tmp_path, cuda=False)
    assert rec["error"] == "RuntimeError: learner exited with 1"
    assert rec["learner_log_head"].startswith("ERROR vLLM could not start: the reason")
    assert "the reason" not in rec["learner_log_tail"]


def test_a_named_layout_too_big_for_the_machine_is_reported_not_dropped(monkeypatch, tmp_path, capsys):
    from trainer.bench import layouts

    monkeypatch.setenv("RM_BENCH_LAYOUTS", "3v1-async,colocate-1")
    monkeypatch.setattr(layouts, "gpu_count", lambda: 2)
    monkeypatch.setattr(layouts, "save_model", lambda work, root, cuda: tmp_path)
    ran = []
    monkeypatch.setattr(layouts, "run_layout", lambda layout, work, *a, **k: ran.append(layout.name) or {
        "name": layout.name, "gpus": layout.gpus, "error": "x"})
    monkeypatch.setattr(layouts, "plot", lambda result, path: None)
    result = layouts.run(tmp_path / "out", work_dir=tmp_path)
    assert ran == ["colocate-1"]
    assert result["skipped"] == [{"name": "3v1-async", "gpus": 4, "why": "needs 4 GPUs, this machine has 2"}]
    assert "skipping 3v1-async: needs 4 GPUs" in capsys.readouterr().out


def _quick_work(monkeypatch, tmp_path, **env):
    """The ``Work`` a quick ``layouts.run`` hands its layouts under ``env`` (nothing launched)."""
    from trainer.bench import layouts

    seen = {}
    for key, value in {"RM_BENCH_LAYOUTS": "colocate-1", **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(layouts, "save_model", lambda work, root, cuda: tmp_path)
    monkeypatch.setattr(layouts, "run_layout", lambda layout, work, *a, **k: seen.setdefault("w", work) and {
        "name": layout.name, "gpus": 1, "error": "x"})
    layouts.run(tmp_path / "out", quick=True, work_dir=tmp_path)
    return seen["w"]


def test_layout_timeout_is_a_knob(monkeypatch, tmp_path):
    assert _quick_work(monkeypatch, tmp_path, RM_BENCH_LAYOUT_TIMEOUT_S="42.5").timeout_s == 42.5


def test_layout_tuner_is_a_knob_that_reaches_the_learner(monkeypatch, tmp_path):
    """``RM_BENCH_LAYOUT_TUNER=dora``: the learner the 3v1 / 6v2 topology files ship, in any layout."""
    from trainer.bench import layouts

    work = _quick_work(monkeypatch, tmp_path, RM_BENCH_LAYOUT_TUNER="dora")
    assert work.tuner == "dora"
    layout = next(x for x in layouts.LAYOUTS if x.name == "3v1-async-auto-compile")
    cfg = validate_config(layout_config(layout, work, tmp_path / "m", tmp_path / "o",
                                        [f"http://127.0.0.1:{8000 + i}" for i in range(3)], cuda=True))
    assert cfg.tuner.train_type == "dora" and cfg.training.compile_decoder_layers
    with pytest.raises(SystemExit, match="RM_BENCH_LAYOUT_TUNER"):
        _quick_work(monkeypatch, tmp_path, RM_BENCH_LAYOUT_TUNER="qlora")


def test_fault_outcome_reads_the_learners_log():
    from trainer.bench.layouts import fault_outcome

    url = "http://127.0.0.1:9"
    log = (f"WARNING quarantining rollout server {url} (nccl broadcast timed out after 120 s): no rollouts\n"
           f"WARNING rollout server {url} re-admitted after a full weight re-sync (...)\n")
    out = fault_outcome({"killed_after_step": 2, "killed_at": 10.0, "restarted_at": 10.5, "healthy_again_at": 70.0},
                        url, log)
    assert out["quarantined"] and out["readmitted"] and out["detected_as"].startswith("nccl broadcast timed out")
    assert out["restarted_after_s"] == 0.5 and out["healthy_again_after_s"] == 60.0
    other = fault_outcome({"killed_at": 1.0}, "http://127.0.0.1:10", log)
    assert not other["quarantined"] and not other["readmitted"], "another server's lines do not count"
    assert "not_injected" in fault_outcome({}, url, "")


def test_a_layout_waits_for_its_gpus_and_names_who_holds_them():
    """Session 16: a learner left over from a stopped layout held 25 GiB of GPU 0 and the next layout's vLLM servers
    failed to start; the bench now waits for the GPUs to be free and names the holders when they stay busy."""
    from trainer.bench.layouts import wait_for_free_gpus

    calls = []

    def exiting(gpus):
        calls.append(gpus)
        return {0: [4242]} if len(calls) < 3 else {}

    wait_for_free_gpus([0, 1], timeout_s=30, holders=exiting)
    assert len(calls) == 3 and calls[0] == [0, 1]
    with pytest.raises(RuntimeError, match=r"GPU 0 by pid\(s\) \[4242\]"):
        wait_for_free_gpus([0, 1], timeout_s=0.5, holders=lambda gpus: {0: [4242]})


def test_figure_marks_missing_efficiency_instead_of_a_zero_bar():
    from trainer.bench.layouts import figure

    work = {"size": "2b", "records_per_step": 64}
    without = {"device": "X", "work": work, "layouts": [
        {"name": "colocate-4", "gpus": 4, "trained_samples_per_s": 10.9},
        {"name": "3v1-sync", "gpus": 4, "trained_samples_per_s": 2.8}]}
    fig = figure(without)
    eff = fig.axes[1]
    assert len(eff.patches) == 0
    assert [t.get_text() for t in eff.texts] == ["no colocate-1\nin this run"] * 2
    with_base = {"device": "X", "work": work, "layouts": [
        {"name": "colocate-1", "gpus": 1, "trained_samples_per_s": 2.3, "per_gpu_efficiency": 1.0},
        {"name": "colocate-4", "gpus": 4, "trained_samples_per_s": 10.9, "per_gpu_efficiency": 1.18}]}
    eff = figure(with_base).axes[1]
    assert [round(p.get_height(), 2) for p in eff.patches] == [1.0, 1.18] and not eff.texts
    assert figure({"device": "X", "work": work, "layouts": [{"name": "a", "gpus": 1}]}) is None
