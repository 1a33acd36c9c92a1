"""``trainer eval`` and the periodic stage-2 eval on the tiny text model (HF rollout backend), and the demo's
determinism on one machine (reduced config)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from tests.cli_runs import torch_process_state_kept
from trainer.cli import main
from trainer.modeling.fixtures import save_tiny_model
from trainer.telemetry import read_jsonl


def write_config(tmp_path: Path, **training) -> Path:
    data = {
        "model": {"tiny": "text"},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64,
                               "eval_num_samples": 4}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "learning_rate": 2e-3, "seed": 0, "disable_tqdm": True, "report_to": ["jsonl"], **training},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 4,
            "decoding": {"max_new_tokens": 24}, "matching": {"mask_resolution": 64}}}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_eval_cli_on_the_tiny_model(tmp_path, capsys):
    cfg = write_config(tmp_path)
    ckpt = save_tiny_model(tmp_path / "ckpt", "text", seed=1)
    out = tmp_path / "eval-out"
    assert main(["eval", "--config", str(cfg), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| F1 @ IoU 0.5 |" in printed and "| AP 0.50:0.95 (COCO) |" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_samples"] == 4 and metrics["title"] == str(ckpt)
    assert metrics["dropped_records"] == 0 and metrics["dropped"] == []
    for key in ("precision@50", "recall@50", "f1@50", "ap", "ap50", "class_ap", "parse_failure_rate",
                "invalid_object_rate", "pred_per_image"):
        assert key in metrics["headline"], key
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == [f"syn-{i:06d}" for i in range(4)]
    assert all(r["tp"] + r["fn"] == len(r["gt"]) and "response" in r and "parse_failure" in r for r in rows)
    assert sum(len(r["gt"]) for r in rows) == metrics["num_gt"]

    # an explicit split, the configured model (no checkpoint), default output folder
    split = tmp_path / "run" / "data-eval" / "eval.jsonl"
    assert main(["eval", "--config", str(cfg), "--split", str(split)]) == 0
    assert (tmp_path / "run" / "eval" / "base" / "metrics.md").is_file()


def test_eval_cli_errors_name_what_to_set(tmp_path, capsys):
    cfg = write_config(tmp_path)
    assert main(["eval", "--config", str(cfg), "--checkpoint", "latest"]) == 2
    assert "--checkpoint latest" in capsys.readouterr().err
    data = yaml.safe_load(cfg.read_text())
    del data["data"]["synthetic"]["eval_num_samples"]
    cfg.write_text(yaml.safe_dump(data))
    assert main(["eval", "--config", str(cfg)]) == 2
    assert "no eval split" in capsys.readouterr().err
    data["training"]["eval_steps"] = 5
    cfg.write_text(yaml.safe_dump(data))
    assert main(["validate", str(cfg)]) == 2
    assert "training.eval_steps" in capsys.readouterr().err


@pytest.mark.slow
def test_periodic_eval_during_stage2_is_logged(tmp_path):
    from trainer.config.schema import load_config
    from trainer.sft.run import run_training

    cfg = load_config(write_config(tmp_path, max_steps=3, eval_steps=2, report_to=["jsonl", "tensorboard"]))
    summary = run_training(cfg)
    evals = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3], "before stage 2, every eval_steps, after the last step"
    assert all("eval/f1@50" in r and "eval/parse_failure_rate" in r for r in evals)
    run = Path(summary.output_dir)
    assert sorted(p.name for p in (run / "eval").glob("step-*")) == ["step-000000", "step-000002", "step-000003"]
    assert list((run / "eval").glob("events.out.tfevents.*")), "eval/ scalars in TensorBoard"


@pytest.mark.slow
def test_demo_is_deterministic_and_reports_before_and_after(tmp_path):
    """Two demo runs (reduced config) on one machine give identical held-out metrics and loss curves."""
    from trainer.demo import run

    demo = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    demo["data"]["synthetic"].update(num_samples=16, eval_num_samples=6)
    demo["training"].update(max_steps=2, eval_steps=0, per_device_train_batch_size=4, disable_tqdm=True,
                            report_to=["jsonl"])
    demo["stage1"].update(steps=30, batch_size=8, logging_steps=10)
    rm = demo["custom"]["extra"]["rollout_matching"]
    rm["decoding"]["max_new_tokens"] = 48
    rm["rollout_generate_batch_size"] = 6
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(yaml.safe_dump(demo))

    def one(name: str) -> tuple[list[dict], str]:
        out = tmp_path / name
        with torch_process_state_kept():
            assert run(argparse.Namespace(config=str(cfg), output_dir=str(out), threads=1)) == 0
        rows = read_jsonl(out / "metrics.jsonl")
        keep = [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "gc/", "eval/seconds", "speed/"))
                 and "_per_second" not in k and k not in ("train_runtime",)} for r in rows]
        report = (out / "REPORT.md").read_text()
        return keep, report[report.index("## Held-out evaluation"):report.index("Plot:")]

    rows_a, table_a = one("a")
    rows_b, table_b = one("b")
    evals = [r for r in rows_a if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert "after stage-1 warm-up (stage-2 step 0)" in table_a and "after stage 2 (step 2)" in table_a
    assert table_a == table_b
    assert [r for r in rows_a if "loss" in r or r["phase"] == "eval"] == [r for r in rows_b if "loss" in r or r["phase"] == "eval"]
