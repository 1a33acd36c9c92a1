"""Learning tables (``kind: learning``): checked when they load, each run's record read from its metrics (held-out
metrics after each stage, mismatch, times), the mean and spread over seeds, and (slow) a tiny table end to end
through torchrun: each variant at each seed, with the held-out split scored after stage 1 and after stage 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainer.bench import learning, runner
from trainer.bench.table import BenchTableError, load_table, variant_config

REPO = Path(__file__).resolve().parents[2]

TINY = {
    "model": {"tiny": "vl", "torch_dtype": "float32"},
    "data": {"synthetic": {"num_samples": 48, "min_objects": 1, "max_objects": 2, "image_size": 64,
                           "eval_num_samples": 8}},
    "training": {"output_dir": "unused", "max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-4,
                 "logging_steps": 1, "eval_steps": 2, "report_to": ["jsonl"], "save_steps": 0, "bf16": False,
                 "disable_tqdm": True},
    "stage1": {"steps": 6, "learning_rate": 1e-3, "batch_size": 8, "logging_steps": 2},
    "custom": {"trainer_variant": "rollout_matching_sft", "extra": {"rollout_matching": {
        "rollout_backend": "hf", "rollout_generate_batch_size": 4,
        "decoding": {"max_new_tokens": 24, "temperature": 0.0}}}},
}


def _table(tmp_path: Path, **top) -> Path:
    path = tmp_path / "learning.yaml"
    path.write_text(yaml.safe_dump({"kind": "learning", "seeds": [0, 1], "base": TINY,
                                    "variants": [{"name": "hf"}], **top}))
    return path


def _lines(path: Path) -> str:
    with pytest.raises(BenchTableError) as exc:
        load_table(path)
    return str(exc.value)


def test_shipped_learning_tables_load_with_every_backend():
    gpu = load_table(REPO / "benchmarks" / "learning.yaml")
    assert gpu.kind == "learning" and len(gpu.seeds) >= 3
    backends = {learning.backend_of(variant_config(gpu, v, REPO / "benchmarks")) for v in gpu.variants}
    assert backends == {"hf", "vllm-colocate", "vllm-server"}
    server = next(v for v in gpu.variants if v.servers)
    assert server.share_gpu and server.gpus == 1, "the server shares the learner's one GPU"
    cpu = load_table(REPO / "benchmarks" / "learning-cpu.yaml")
    assert len(cpu.seeds) >= 3
    cfg = variant_config(cpu, cpu.variants[0], REPO / "benchmarks", seed=2)
    assert cfg["model"]["tiny"] == "vl" and "path" not in cfg["model"], "a learning run builds its own model"
    assert cfg["data"]["synthetic"]["eval_num_samples"] >= 200, "the CPU held-out set is large enough to compare"
    assert (cfg["training"]["seed"], cfg["model"]["tiny_seed"], cfg["data"]["synthetic"]["seed"]) == (2, 2, 2)


def test_learning_tables_that_cannot_measure_learning_are_refused(tmp_path):
    assert "seeds:" in _lines(_table(tmp_path, seeds=[]))
    assert "seeds:" in _lines(_table(tmp_path, seeds=[1, 1]))
    assert "a learning table trains the model its configs name" in _lines(_table(tmp_path, model="tiny"))
    no_eval = {**TINY, "data": {"synthetic": {"num_samples": 8}}, "training": {**TINY["training"], "eval_steps": 0}}
    assert "training.eval_steps: a learning run scores a held-out split" in _lines(_table(tmp_path, base=no_eval))
    no_warmup = {**TINY, "stage1": {"steps": 0}}
    assert "stage1.steps" in _lines(_table(tmp_path, base=no_warmup))
    speed = tmp_path / "speed.yaml"
    speed.write_text(yaml.safe_dump({"seeds": [0], "model": "tiny", "base": TINY, "variants": [{"name": "a"}]}))
    assert "only a learning table" in _lines(speed)
    shared = _table(tmp_path, variants=[{"name": "s", "servers": 2, "share_gpu": True}])
    assert "share_gpu" in _lines(shared)


def _metrics(run: Path, before: float, after: float, mismatch: list[float]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"phase": "stage1", "step": 1, "loss": 2.0, "time": 10.0},
            {"phase": "stage1", "step": 50, "loss": 1.0, "time": 40.0},
            {"phase": "eval", "step": 0, "eval/f1@50": before, "eval/ap": before / 4, "eval/num_samples": 200.0,
             "eval/parse_failure_rate": 0.1},
            *[{"phase": "stage2", "step": i + 1, "loss": 1.0, "time": 50.0 + 5 * i,
               "mismatch/logp_abs_diff_mean": m, "mismatch/logp_abs_diff_max": 10 * m, "mismatch/kl_k3": m / 100}
              for i, m in enumerate(mismatch)],
            {"phase": "eval", "step": len(mismatch), "eval/f1@50": after, "eval/ap": after / 4,
             "eval/num_samples": 200.0, "eval/parse_failure_rate": 0.05}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_record_holds_both_evaluations_the_mismatch_and_the_times(tmp_path):
    _metrics(tmp_path, 0.2, 0.3, [0.001, 0.003])
    rec = learning.learning_record(tmp_path)
    assert rec["after_stage1"]["f1@50"] == 0.2 and rec["after_stage2"]["f1@50"] == 0.3
    assert rec["delta"]["f1@50"] == pytest.approx(0.1) and rec["delta"]["parse_failure_rate"] == pytest.approx(-0.05)
    assert "num_samples" not in rec["delta"] and rec["held_out"] == 200
    assert (rec["stage1_steps"], rec["stage2_steps"], rec["stage1_wall_s"], rec["stage2_wall_s"]) == (50, 2, 30.0, 5.0)
    assert rec["mismatch"]["logp_abs_diff_mean"] == pytest.approx(0.002)
    assert rec["mismatch"]["logp_abs_diff_max"] == pytest.approx(0.03) and rec["mismatch"]["steps"] == 2


def test_a_run_with_one_evaluation_is_an_error_that_says_what_to_set(tmp_path):
    _metrics(tmp_path, 0.2, 0.3, [0.001])
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    with pytest.raises(RuntimeError, match="eval_num_samples"):
        learning.learning_record(tmp_path)


def test_the_summary_gives_mean_and_spread_per_variant_and_names_failed_seeds():
    def rec(variant, seed, before, after, error=None):
        r = {"variant": variant, "seed": seed, "backend": "hf"}
        if error:
            return {**r, "error": error}
        return {**r, "after_stage1": {"f1@50": before, "ap": 0.0}, "after_stage2": {"f1@50": after, "ap": 0.01},
                "delta": {"f1@50": after - before, "ap": 0.01, "parse_failure_rate": 0.0},
                "mismatch": {"logp_abs_diff_mean": 0.001}}

    s = learning.summarise([rec("a", 0, 0.2, 0.3), rec("a", 1, 0.4, 0.5), rec("a", 2, 0.3, 0.2),
                            rec("b", 0, 0.1, 0.2), rec("b", 1, 0, 0, error="RuntimeError: boom")])
    a, b = s["a"], s["b"]
    assert a["seeds"] == [0, 1, 2] and a["delta"]["f1@50"]["mean"] == pytest.approx(0.1 / 3)
    assert a["delta"]["f1@50"]["std"] == pytest.approx(0.11547, rel=1e-3) and a["delta"]["f1@50"]["n"] == 3
    assert a["after_stage1"]["f1@50"]["mean"] == pytest.approx(0.3) and not a["helps_at_every_seed"]
    assert b["seeds"] == [0] and b["failed_seeds"] == [1] and b["helps_at_every_seed"]
    table = learning.markdown(s)
    assert "| a | hf | 3 | 0.300 ± 0.100 | 0.333 ± 0.153 | +0.033 ± 0.115 |" in table


@pytest.mark.slow
def test_a_tiny_learning_table_runs_each_seed_end_to_end(tmp_path):
    """Two seeds of the tiny VL detector through the runner (torchrun, ``trainer train``): each record has the held-out
    metrics after both stages, the stage-2 mismatch (the HF engine is the learner: near zero) and its seed's data."""
    path = _table(tmp_path)
    result = runner.run(load_table(path), path, tmp_path / "out", work_dir=tmp_path / "work")
    recs = result["records"]
    assert [(r["variant"], r["seed"]) for r in recs] == [("hf", 0), ("hf", 1)]
    for r in recs:
        assert "error" not in r, (r.get("error"), r.get("learner_log_tail", "")[-2000:])
        assert r["held_out"] == 8 and r["stage1_steps"] == 6 and r["stage2_steps"] == 2
        assert r["after_stage2"]["f1@50"] - r["after_stage1"]["f1@50"] == pytest.approx(r["delta"]["f1@50"])
        # measured on the rollout tokens a target keeps: a 6-step warm-up may write no complete object to keep
        assert r["mismatch"] is None or r["mismatch"]["logp_abs_diff_mean"] < 1e-3
        assert r["config"]["training"]["seed"] == r["seed"] == r["config"]["model"]["tiny_seed"]
    data = [(tmp_path / "work" / "runs" / f"hf@seed{i}" / "data" / "train.jsonl").read_text() for i in (0, 1)]
    assert data[0] != data[1], "each seed draws its own scenes"
    assert result["summary"]["hf"]["seeds"] == [0, 1] and result["summary"]["hf"]["delta"]["f1@50"]["n"] == 2
    written = json.loads((tmp_path / "out" / "learning.json").read_text())
    assert written["summary"] == json.loads(json.dumps(result["summary"]))


@pytest.mark.slow
def test_a_shared_warm_up_feeds_stage2_and_its_control_at_side_by_side_seeds(tmp_path):
    """``shared_warmup``: one warm-up per seed, every variant starts stage 2 from its checkpoint (no stage-1 step of
    its own, the same held-out score before stage 2); ``control``: each variant is compared with it and with the
    warm-up, with a bootstrap interval that holds the difference; ``parallel_seeds`` runs the seeds side by side."""
    control = {"custom": {"extra": {"rollout_matching": {"targets": "ground_truth"}}}}
    path = _table(tmp_path, shared_warmup=True, control="control", parallel_seeds=True, bootstrap_draws=200,
                  variants=[{"name": "hf"}, {"name": "control", "config": control}])
    runner.PARALLEL_SEED_STAGGER_S = 0.0
    result = runner.run(load_table(path), path, tmp_path / "out", work_dir=tmp_path / "work")
    recs = {r["name"]: r for r in result["records"]}
    assert set(recs) == {f"{v}@seed{s}" for v in ("warmup", "hf", "control") for s in (0, 1)}
    for r in recs.values():
        assert "error" not in r, (r.get("error"), r.get("learner_log_tail", "")[-2000:])
    for seed in (0, 1):
        warm = recs[f"warmup@seed{seed}"]
        assert warm["stage1_steps"] == 6
        for v in ("hf", "control"):
            r = recs[f"{v}@seed{seed}"]
            assert r["stage1_steps"] == 0 and r["stage2_steps"] == 2
            assert r["after_stage1"]["f1@50"] == pytest.approx(warm["after_stage1"]["f1@50"]), "starts from the warm-up"
            assert r["config"]["model"]["path"].endswith(f"warmup@seed{seed}/final")
    assert recs["control@seed0"]["mismatch"] is None, "the control decodes no training rollouts"
    pairs = {(c["seed"], c["variant"], c["against"]) for c in result["comparisons"]}
    assert pairs == {(s, v, a) for s in (0, 1) for v, a in (("hf", "stage 1"), ("hf", "control"),
                                                           ("control", "stage 1"))}
    for c in result["comparisons"]:
        for key in ("f1@50", "ap"):
            assert c[key]["low"] <= c[key]["diff"] <= c[key]["high"] and c[key]["draws"] == 200
    assert set(result["summary"]) == {"hf", "control"}
