"""Stage 2 under torchrun on CPU (gloo): several ranks share one synthetic set written once per node, decode their
step's records together, agree on the number of packed rows (zero-weight fillers where a rank has fewer) and train
every sample exactly once, with nothing lost across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from trainer.launch.ports import listen_port


def _config(root: Path, records_per_step: int) -> dict:
    return {
        "model": {"tiny": "text", "tiny_seed": 0},
        "data": {"synthetic": {"num_samples": 24, "seed": 11, "min_objects": 1, "max_objects": 6, "image_size": 64}},
        "training": {"output_dir": str(root / "run"), "max_steps": -1, "num_train_epochs": 1,
                     "records_per_step": records_per_step, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0,
                     "disable_tqdm": True, "report_to": ["jsonl"], "packing": True, "packing_length": 512,
                     "packing_buffer": 64},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 8,
            "decoding": {"max_new_tokens": 48}, "matching": {"mask_resolution": 64}}}},
    }


@pytest.mark.slow
def test_two_ranks_train_every_sample_once_with_agreed_rows(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg_data = _config(tmp_path, records_per_step=12)
    cfg_data["training"]["cpu_threads_per_rank"] = 2
    cfg.write_text(yaml.safe_dump(cfg_data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(listen_port()), "-m", "trainer", "train", "--config", str(cfg)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rank1 = "\n".join(x for x in proc.stderr.splitlines() if "[rank1]" in x and "Warning" not in x)
    assert proc.returncode == 0, f"rank 1:\n{rank1[-6000:]}\n---\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    stage2 = tmp_path / "run" / "stage2"
    ledgers = {0: stage2 / "ledger.jsonl", 1: stage2 / "ledger.rank1.jsonl"}
    rows = {r: [json.loads(x) for x in p.read_text().splitlines()] for r, p in ledgers.items()}
    ids = [x["sample_id"] for r in rows.values() for x in r]
    carried = [json.loads(x)["sample_id"] for name in ("carried.jsonl", "carried.rank1.jsonl")
               for x in (stage2 / name).read_text().splitlines()]
    assert Counter(ids).most_common(1)[0][1] == 1, "no sample trained twice across ranks"
    assert not {x["sample_id"] for x in rows[0]} & {x["sample_id"] for x in rows[1]}, "ranks train disjoint shares"
    assert len(ids) + len(carried) == 24 and not set(ids) & set(carried), \
        "every record is in exactly one rank's ledger or carry"
    assert len(carried) < 2 * 8, "at most what fits less than a row per rank is left in the carries"
    data = tmp_path / "run" / "data"
    assert len(list((data / "images").glob("*.png"))) == 24 and not list(data.rglob("*.tmp")), "written once, whole"
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    setup = next(m for m in metrics if m.get("phase") == "setup")
    assert setup["train/cpu_threads_per_rank"] == 2, "torchrun's OMP_NUM_THREADS=1 left the configured count unset"
    assert setup["train/cpu_threads_reason"] == "training.cpu_threads_per_rank"
    from trainer.sft.cpu_threads import host_gpu_count

    expected = "PASSIVE" if host_gpu_count() else None  # python -m trainer sets it on a GPU host, before torch loads
    assert setup["train/omp_wait_policy"] == expected and setup["train/omp_wait_policy_reason"], \
        "each rank records how its idle OpenMP threads wait, and why"
    steps = [m for m in metrics if m.get("phase") == "stage2" and "loss" in m]
    assert len(steps) == 2, "24 records / 12 per step (6 on each of 2 ranks)"
    assert all(m["rollout/samples"] == 6 for m in steps), "rank 0 decoded its 6 records of every step at once"
    assert max(m["batch/rows_per_step"] for m in steps) > 1, "a step's records fill several 512-token rows"
    assert all(m["grad_norm"] > 0 and m["loss"] == m["loss"] for m in steps)
    assert all(0.0 <= m["time/rows_agree_s"] <= m["time/target_s"] for m in steps), \
        "the ranks' wait for each other's row count is timed inside the target phase"
