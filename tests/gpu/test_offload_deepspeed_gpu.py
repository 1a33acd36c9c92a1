"""offload_for_rollout on a CUDA GPU with real single-process DeepSpeed ZeRO-1/2/3 engines (real device moves, no
simulation): the same worker as tests/integration/test_offload_deepspeed.py plus CUDA memory freed inside the block
and a timing/bytes benchmark. Run on the device machine (one GPU):

    PYTHONPATH=<carried site-packages>:. python -m pytest -q -m gpu -s tests/gpu/test_offload_deepspeed_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parents[1] / "integration" / "ds_offload_worker.py"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not importable"),
]


def run_worker(*args: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    env.pop("DS_ACCELERATOR", None)
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=1200, env=env,
                          cwd=WORKER.parents[2])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OFFLOAD_REPORT ")]
    assert lines, f"worker printed no report (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1].split(" ", 1)[1])
    if "error" in report and "FusedAdam" in report.get("traceback", "") and (
            "ninja" in report["traceback"].lower() or "build" in report["traceback"].lower()):
        pytest.skip(f"DeepSpeed FusedAdam could not be JIT-built here (needs ninja + nvcc): {report['error']}")
    assert "error" not in report, report.get("traceback", report)
    return report


def _keep(name: str, rep: dict) -> None:
    """On the device machine, $OUT comes back: keep the full report there for reading after the run."""
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        Path(out, f"{name}.json").write_text(json.dumps(rep, indent=1))


@pytest.mark.parametrize("stage,optim", [("1", "torch"), ("2", "torch"), ("3", "torch"), ("3", "fused")])
def test_offload_round_trip_and_step_equivalence_on_gpu(stage, optim):
    rep = run_worker("--stage", stage, "--optim", optim)
    print(json.dumps({k: v for k, v in rep.items() if k != "points"}))
    _keep(f"round_trip_zero{stage}_{optim}", rep)
    for point in rep["points"]:
        # devices of the tensors holding the values (ZeRO-3: p.ds_tensor; its p.data is an empty placeholder that
        # DeepSpeed leaves on the GPU, see ds_offload_worker.param_data_devices)
        assert point["inside_param_devices"] == ["cpu"], point
        assert point["inside_gathered_zero3_params"] == 0, point
        # what is still on the GPU inside the block, by real device. ZeRO-1 keeps a pending (GA) gradient in the
        # unpartitioned bf16 p.grad of its managed params, which DeepSpeed's ZeRO-1 offload_states does not move:
        # a known gap, pinned here so a change shows up
        left = {"param_grads"} if stage == "1" and point["micro"] in (1, 3) else set()
        assert set(point["inside_accelerator_bytes"]) == left, point
        assert point["after_offloaded_states"] == [] and point["round_trip_diff"] == [] and point["views_intact"]
        assert point["cuda_bytes_inside"] < point["cuda_bytes_before"], point
    assert rep["points"][2]["raised"]
    assert rep["trained"] and rep["losses"] == rep["ref_losses"] and rep["final_diff"] == []
    assert "model_wrapped" in rep["bare_module_refused"]


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_offload_bench_on_gpu(stage):
    """~117M params (bf16 + fp32 master + AdamW): bytes moved, seconds each way, memory left inside the block."""
    rep = run_worker("--stage", stage, "--bench", "--hidden", "4096", "--layers", "7")
    _keep(f"bench_zero{stage}", rep)
    print("BENCH", json.dumps(rep))
    moved = rep["param_bytes"] + rep["optimizer_bytes"]
    assert moved >= 14 * rep["params"] * 0.99  # 2 (bf16) + 4 (fp32 master) + 8 (AdamW), per parameter
    assert rep["peak_during_gib"] is not None and rep["peak_during_gib"] * 2**30 < 0.2 * moved
