"""offload_for_rollout against real single-process DeepSpeed ZeRO-1/2/3 engines (CPU accelerator, gloo, world size 1).

Each configuration runs in a subprocess (tests/integration/ds_offload_worker.py): DeepSpeed initialises
torch.distributed and its accelerator process-wide. On CPU the worker's --simulate makes our own moves copy into fresh
storage (DeepSpeed's pinned-buffer path copies anyway), so stale views or lost aliasing show up as after a GPU
round-trip. The same worker runs without --simulate on a GPU in tests/gpu/test_offload_deepspeed_gpu.py.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ds_offload_worker.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (pip install -e '.[deepspeed]')")


@functools.cache
def run_worker(*args: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_PLUGINS": ""}
    # 1800 s bounds a hang only: a worker takes ~25 s, the first one on a fresh machine also waits for DeepSpeed's
    # CPU ops to build (tests/deepspeed_ops.py; minutes on a loaded 2-core machine)
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=1800, env=env,
                          cwd=WORKER.parents[2])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OFFLOAD_REPORT ")]
    assert lines, f"worker printed no report (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1].split(" ", 1)[1])
    if "error" in report and "FusedAdam" in report.get("traceback", "") and "build" in report["traceback"].lower():
        pytest.skip(f"DeepSpeed FusedAdam op could not be built on this host: {report['error']}")
    assert "error" not in report, report.get("traceback", report)
    return report


CONFIGS = [("1", "torch"), ("2", "torch"), ("3", "torch"), ("3", "fused")]
EXPECTED = {  # which DeepSpeed state types are offloaded inside the block
    "1": {"hp_params", "lp_grads", "lp_params", "optim_states"},
    "2": {"hp_params", "lp_grads", "lp_params", "optim_states"},
    # torch AdamW: DeepSpeed's ZeRO-3 path only takes FusedAdam, so fp32 partitions + Adam state are moved by us
    ("3", "torch"): {"contiguous_grad_buffer", "lp_grads", "lp_params"},
    ("3", "fused"): {"contiguous_grad_buffer", "hp_params", "lp_grads", "lp_params", "optim_states"},
}


def _report(stage: str, optim: str) -> dict:
    return run_worker("--stage", stage, "--optim", optim, "--simulate")


@pytest.mark.parametrize("stage,optim", CONFIGS)
def test_round_trip_is_exact_at_every_point(stage, optim):
    """Before the first micro-batch, with a gradient pending (GA=2), at the step boundary, pending again."""
    rep = _report(stage, optim)
    expected = EXPECTED.get((stage, optim), EXPECTED.get(stage))
    assert len(rep["points"]) == 4
    for point in rep["points"]:
        assert set(point["inside_offloaded_states"]) == expected, point
        assert point["inside_param_devices"] == ["cpu"], point  # ZeRO-3: p.ds_tensor (p.data is a placeholder)
        assert point["inside_gathered_zero3_params"] == 0, point  # no full ZeRO-3 copy left gathered
        assert point["inside_accelerator_bytes"] == {}, point  # by real device: meaningful on the GPU run only
        assert point["after_offloaded_states"] == [], point
        assert point["round_trip_diff"] == [], f"state changed by the round trip at micro {point['micro']}"
        assert point["views_intact"], f"ZeRO bf16 params no longer views of the flat buffer at {point['micro']}"
        assert point["stats"]["backend"] == f"deepspeed-zero{stage}"
        assert point["stats"]["param_bytes"] > 0 and point["stats"]["optimizer_bytes"] > 0
    # the optimizer state exists after the first step, so more optimizer bytes move at the boundary
    assert rep["points"][2]["stats"]["optimizer_bytes"] > rep["points"][0]["stats"]["optimizer_bytes"]


@pytest.mark.parametrize("stage,optim", CONFIGS)
def test_training_after_offload_equals_training_without(stage, optim):
    rep = _report(stage, optim)
    assert rep["initial_equal_to_ref"]
    assert rep["trained"], "the two optimizer steps did not change the state: the comparison would be vacuous"
    assert rep["global_steps"] == [2, 2]
    assert rep["losses"] == rep["ref_losses"]
    assert rep["final_diff"] == [], f"params/master weights/optimizer state differ: {rep['final_diff']}"


@pytest.mark.parametrize("stage,optim", CONFIGS)
def test_exception_inside_block_restores(stage, optim):
    rep = _report(stage, optim)
    point = rep["points"][2]
    assert point["raised"], "the worker's 'decode failed' did not propagate out of the block"
    assert point["after_offloaded_states"] == [] and point["round_trip_diff"] == [] and point["views_intact"]
    assert rep["final_diff"] == []  # and training went on exactly as without offload


@pytest.mark.parametrize("stage", ["2", "3"])
def test_bare_module_with_zero_optimizer_is_refused(stage):
    """HF's Trainer.model is the bare module; the plain path would leave ZeRO's buffers in place."""
    rep = _report(stage, "torch")
    assert "model_wrapped" in rep["bare_module_refused"]


def test_why_the_bare_module_is_refused():
    """Plain p.data moves on a ZeRO-2 engine: params detach from the flat buffer, which itself does not move."""
    rep = run_worker("--stage", "2", "--negative-control", "--simulate")
    assert rep == {"views_intact_inside": False, "flat_moved": False, "views_intact_after": False}
