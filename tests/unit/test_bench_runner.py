"""``python -m trainer bench run``: the measurement of a run from its metrics and every rank's ledger, the ratios
against a variant's baseline, the GPU wait, failures recorded with their learner log, variants too big for the
machine reported, and (slow) the CPU table end to end through ``trainer serve`` and torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.bench import runner
from trainer.bench.measure import measure
from trainer.bench.table import load_table

REPO = Path(__file__).resolve().parents[2]


def _write_run(run: Path, times: list[float], per_rank: dict[int, list[list[str]]], **extra: float) -> None:
    (run / "stage2").mkdir(parents=True)
    rows = [{"phase": "stage2", "step": i + 1, "loss": 1.0, "time": t, "time/weight_sync_s": 0.5 + i,
             "batch/rows_per_step": 3.0, **extra} for i, t in enumerate(times)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for rank, steps in per_rank.items():
        name = "ledger.jsonl" if rank == 0 else f"ledger.rank{rank}.jsonl"
        lines = [json.dumps({"epoch": 0, "sample_id": sid, "step": step}) for step, ids in enumerate(steps) for sid in ids]
        (run / "stage2" / name).write_text("\n".join(lines) + "\n")


def test_measure_counts_every_rank_after_the_warm_up(tmp_path):
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a", "b"], ["c"], ["d", "e"]], 1: [["f"], ["g", "h"], ["i"]]})
    m = measure(tmp_path, records_per_step=3)
    assert m["trained_samples"] == 6, "steps 2 and 3 on both ranks; step 1 is warm-up"
    assert m["trained_samples_per_s"] == pytest.approx(6 / 6.0) and m["step_wall_s"] == pytest.approx(3.0)
    assert m["means"]["time/weight_sync_s"] == pytest.approx(2.0), "mean over the measured steps only"
    assert m["ledger"] == {"rows": 9, "duplicated": 0, "carried": 0, "carried_and_trained": 0, "unaccounted": 0}
    assert m["recompiles_after_first_step"] is None, "not logged: unknown, not 0"


def test_measure_counts_the_carry_of_every_rank_and_what_no_rank_holds(tmp_path):
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a"], ["b"], ["c"]], 1: [["d"], ["e"], ["f"]]})
    (tmp_path / "stage2" / "carried.jsonl").write_text(json.dumps({"sample_id": "g", "rollout_step": 2}) + "\n")
    (tmp_path / "stage2" / "carried.rank1.jsonl").write_text(
        "".join(json.dumps({"sample_id": s, "rollout_step": 2}) + "\n" for s in ("h", "c")))
    m = measure(tmp_path, records_per_step=3)
    assert m["ledger"]["carried"] == 3 and m["ledger"]["carried_and_trained"] == 1, "'c' was trained and is carried"
    assert m["ledger"]["unaccounted"] == 3 * 3 - 6 - 3
    assert measure(tmp_path, records_per_step=4)["ledger"]["unaccounted"] == 3, "3 records a step went nowhere"


def test_measure_reports_the_learner_settings_that_ran_and_the_recompiles(tmp_path):
    _write_run(tmp_path, [100.0, 104.0, 106.0], {0: [["a"], ["b"], ["c"]]},
               **{"compile/recompiles_after_first_step": 2.0})
    rows = (tmp_path / "metrics.jsonl").read_text()
    setup = {"phase": "setup", "step": 0, "time": 99.0, "train/checkpointing_policy": "selective",
             "train/checkpointed_layers": 14, "train/compile_activation_memory_budget": 0.4}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(setup) + "\n" + rows)
    m = measure(tmp_path, records_per_step=1)
    assert m["learner"] == {"checkpointing_policy": "selective", "checkpointed_layers": 14,
                            "compile_activation_memory_budget": 0.4}
    assert m["steps_measured"] == 2, "the setup row is not a step"
    assert m["recompiles_after_first_step"] == 2.0


def test_compare_is_per_gpu_against_each_variant_s_baseline():
    recs = [{"name": "colocate-1", "baseline": "colocate-1", "gpus": 1, "trained_samples_per_s": 2.0},
            {"name": "colocate-4", "baseline": "colocate-1", "gpus": 4, "trained_samples_per_s": 10.0},
            {"name": "levers-4", "baseline": "colocate-4", "gpus": 4, "trained_samples_per_s": 12.0},
            {"name": "orphan", "baseline": "not-run", "gpus": 2, "trained_samples_per_s": 3.0},
            {"name": "failed", "baseline": "colocate-1", "gpus": 2, "error": "x"}]
    runner.compare(recs)
    assert recs[0]["per_gpu_vs_baseline"] == 1.0
    assert recs[1]["speedup_vs_baseline"] == 5.0 and recs[1]["per_gpu_vs_baseline"] == 1.25
    assert recs[2]["per_gpu_vs_baseline"] == 1.2, "against a 4-GPU baseline, per GPU on both sides"
    assert recs[3]["trained_samples_per_s_per_gpu"] == 1.5 and "per_gpu_vs_baseline" not in recs[3]
    assert "trained_samples_per_s_per_gpu" not in recs[4]


def test_a_variant_waits_for_its_gpus_and_names_who_holds_them():
    calls = []

    def exiting(gpus):
        calls.append(gpus)
        return {0: [4242]} if len(calls) < 3 else {}

    runner.wait_for_free_gpus([0, 1], timeout_s=30, holders=exiting)
    assert len(calls) == 3 and calls[0] == [0, 1]
    with pytest.raises(RuntimeError, match=r"GPU 0 by pid\(s\) \[4242\]"):
        runner.wait_for_free_gpus([0, 1], timeout_s=0.5, holders=lambda gpus: {0: [4242]})


def test_a_failed_variant_keeps_the_head_of_its_learner_log(tmp_path, monkeypatch):
    """vLLM's start-up error is at the top of the learner's log: a failure record carries the head and the tail."""

    def learner_that_fails(argv, log, gpus):
        log.write_text("ERROR vLLM could not start: the reason\n" + "noise\n" * 5000)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(runner, "_popen", learner_that_fails)
    table = load_table(REPO / "benchmarks" / "cpu.yaml")
    rec = runner.run_variant(table, table.variants[0], REPO / "benchmarks", tmp_path / "m", tmp_path, cuda=False)
    assert rec["error"] == "RuntimeError: learner exited with 1"
    assert rec["learner_log_head"].startswith("ERROR vLLM could not start: the reason")
    assert "the reason" not in rec["learner_log_tail"]
    assert rec["config"]["training"]["output_dir"] == str(tmp_path / "runs" / "colocate-1"), "the config that ran"


def test_a_variant_too_big_for_the_machine_is_reported_not_dropped(monkeypatch, tmp_path, capsys):
    table = load_table(REPO / "benchmarks" / "layouts.yaml")
    monkeypatch.setattr(runner, "gpu_names", lambda: ["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.setattr(runner, "save_model", lambda size, root, cuda: tmp_path)
    ran = []
    monkeypatch.setattr(runner, "run_variant", lambda table, v, *a: ran.append(v.name) or {
        "name": v.name, "gpus": v.gpus, "baseline": v.name, "error": "x"})
    result = runner.run(table, Path("benchmarks/layouts.yaml"), tmp_path / "out", only="3v1-async,colocate-1",
                        work_dir=tmp_path)
    assert ran == ["colocate-1"]
    assert result["skipped"] == [{"name": "3v1-async", "why": "needs 4 GPUs, this machine has 2"}]
    assert "skipping 3v1-async: needs 4 GPUs" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "layouts.json").read_text())
    (rec,) = saved["records"]
    assert rec["machine"] == "2 x NVIDIA H200" and rec["date"] and "torch" in rec
    assert rec["command"] == "python -m trainer bench run benchmarks/layouts.yaml --only colocate-1"


def test_a_gpu_table_on_a_cpu_machine_is_refused_before_anything_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "gpu_names", lambda: [])
    monkeypatch.setattr(runner, "save_model", lambda *a: pytest.fail("nothing may start"))
    with pytest.raises(SystemExit, match=r"Qwen3-VL-2B.*needs CUDA GPUs.*benchmarks/cpu.yaml"):
        runner.run(load_table(REPO / "benchmarks" / "layouts.yaml"), Path("benchmarks/layouts.yaml"), tmp_path)


@pytest.mark.slow
def test_the_cpu_table_runs_end_to_end(tmp_path):
    """Every kind of placement the runner starts (one rank, two gloo ranks, a rollout server beside the learner)
    trains, is measured from every rank's ledger, and is set against its baseline."""
    result = runner.run(load_table(REPO / "benchmarks" / "cpu.yaml"), Path("benchmarks/cpu.yaml"), tmp_path / "out",
                        work_dir=tmp_path / "work")
    assert [r["name"] for r in result["records"]] == ["colocate-1", "colocate-2", "1v1-async"]
    for r in result["records"]:
        assert "error" not in r, (r["name"], r.get("error"), r.get("learner_log_tail", "")[-2000:])
        assert r["trained_samples_per_s"] > 0 and r["ledger"]["duplicated"] == 0 and r["ledger"]["unaccounted"] == 0
        assert r["ledger"]["rows"] >= 4, "every rank's ledger is read"
        assert r["per_gpu_vs_baseline"] > 0 and r["phases"]["step_wall_s"] > 0
        assert r["recompiles_after_first_step"] is None, "an eager CPU run logs no compile metric"
        assert r["config"]["model"]["path"].endswith("qwen3-vl-tiny-random")
    assert (tmp_path / "work" / "runs" / "colocate-2" / "stage2" / "ledger.rank1.jsonl").is_file(), "two ranks ran"
    assert result["records"][2]["servers_ready_s"] >= 0
    assert result["records"][2]["server"] == {"engine": "hf", "gpu_memory_utilization": 0.85, "max_model_len": 4096}, \
        "a record with servers names the engine settings they ran with (cpu.yaml's `server: {engine: hf}`)"
    assert "server" not in result["records"][0], "no servers, no server settings"
    assert json.loads((tmp_path / "out" / "cpu.json").read_text())["records"] == \
        json.loads(json.dumps(result["records"]))


@pytest.mark.parametrize("node_bound", [False, True])
def test_servers_start_as_a_user_starts_them(tmp_path, node_bound):
    """Each bench server is ``python -m trainer launch server`` on its host GPU, with ``--cpu-affinity node`` exactly
    when the variant's learner is node-bound (the server presets); the launcher accepts the argv and builds the
    ``trainer serve`` command with the table's engine settings and the port."""
    table = load_table(REPO / "benchmarks" / "layouts.yaml")
    variant = next(v for v in table.variants if v.servers and v.server is None)
    argv = runner.server_argv(table, variant, tmp_path / "model", 8123, 2, node_bound)
    assert argv[1:5] == ["-m", "trainer", "launch", "server"]
    assert ("--cpu-affinity" in argv) is node_bound
    split = argv.index("--")
    out = subprocess.run(argv[:split] + ["--print-command"] + argv[split:], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert "-m trainer serve --engine vllm --host 127.0.0.1 --port 8123" in line
    assert f"--model {tmp_path / 'model'}" in line and "--log-level warning" in line
    assert f"--max-model-len {table.server.max_model_len}" in line and "CUDA_VISIBLE_DEVICES=2" in line


def test_a_variant_s_server_settings_replace_the_table_s_for_its_servers(tmp_path):
    """``6v2-shipped`` starts its servers as ``presets/6v2-2b-full.values.yaml``'s ``rolloutServer`` does (0.6 of the
    GPU, 8,192 tokens), not with the table's defaults; a variant without its own ``server`` takes the table's."""
    table = load_table(REPO / "benchmarks" / "layouts.yaml")
    variant = next(v for v in table.variants if v.name == "6v2-shipped")
    values = yaml.safe_load((REPO / "presets" / "6v2-2b-full.values.yaml").read_text())["rolloutServer"]
    assert variant.server is not None and variant.server != table.server
    flags = _flags(runner.server_argv(table, variant, tmp_path / "model", 8123, 0, False))
    assert float(flags["--gpu-memory-utilization"]) == values["gpuMemoryUtilization"]
    assert int(flags["--max-model-len"]) == values["maxModelLen"]
    plain = next(v for v in table.variants if v.servers and v.server is None)
    flags = _flags(runner.server_argv(table, plain, tmp_path / "model", 8123, 0, False))
    assert float(flags["--gpu-memory-utilization"]) == table.server.gpu_memory_utilization
    assert int(flags["--max-model-len"]) == table.server.max_model_len


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


def test_only_a_node_bound_learner_binds_its_servers():
    table = load_table(REPO / "benchmarks" / "layouts.yaml")
    where = REPO / "benchmarks"
    bound = {v.name for v in table.variants if v.servers and runner.servers_node_bound(table, v, where)}
    assert "3v1-preset" in bound, "the 3v1 preset ships node-bound servers and learner"
    assert "3v1-async" not in bound
