"""A stage-2 comparison from one warm-up: ``training.max_steps: 0`` runs the warm-up alone (held-out eval, saved
checkpoint); stage 2 and its control (``rollout_matching.targets: ground_truth``) start from that checkpoint."""

from __future__ import annotations

import json

import yaml

from trainer.cli import main
from trainer.telemetry import read_jsonl


def _config(tmp_path, name, **over):
    cfg = {"model": {"tiny": "vl", "tiny_seed": 0},
           "data": {"synthetic": {"num_samples": 8, "eval_num_samples": 4, "max_objects": 2, "image_size": 64}},
           "training": {"output_dir": str(tmp_path / name), "max_steps": 2, "per_device_train_batch_size": 2,
                        "learning_rate": 1e-4, "report_to": ["jsonl"], "eval_steps": 0},
           "stage1": {"steps": 2, "batch_size": 2, "learning_rate": 1e-3},
           "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "decoding": {"max_new_tokens": 24}}}}}
    for dotted, value in over.items():
        node = cfg
        *head, last = dotted.split("__")
        for key in head:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_warm_up_once_then_stage2_and_control_from_its_checkpoint(tmp_path):
    assert main(["train", "--config", str(_config(tmp_path, "warm", training__max_steps=0))]) in (0, None)
    warm = tmp_path / "warm"
    rows = read_jsonl(warm / "metrics.jsonl")
    assert [r["phase"] for r in rows if r.get("phase") in ("eval", "stage2")] == ["eval"], "one held-out eval, no stage 2"
    assert max(r["step"] for r in rows if r.get("phase") == "stage1") == 2
    final = warm / "final"
    assert (final / "config.json").exists() and (final / "preprocessor_config.json").exists()
    assert json.loads((warm / "run_summary.json").read_text())["stage2_steps"] == 0

    for name, targets in (("stage2", "rollout"), ("control", "ground_truth")):
        path = _config(tmp_path, name, model={"path": str(final)}, stage1__steps=0,
                       custom__extra__rollout_matching__targets=targets)
        assert main(["train", "--config", str(path)]) in (0, None)
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        steps = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
        assert len(steps) == 2 and not any(r.get("phase") == "stage1" for r in rows)
        evals = [r for r in rows if r.get("phase") == "eval"]
        assert len(evals) == 2, "held-out eval before and after"
        decoded = sum(r.get("rollout/samples", 0) for r in steps)
        assert (decoded > 0) == (targets == "rollout"), "the control decodes no training rollouts"


def test_warm_up_only_needs_warm_up_steps(tmp_path, capsys):
    code = main(["validate", str(_config(tmp_path, "bad", training__max_steps=0, stage1__steps=0))])
    assert code == 2
    assert "training.max_steps" in capsys.readouterr().err
