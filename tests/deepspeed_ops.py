"""Build DeepSpeed's CPU ops that the suite's DeepSpeed tests JIT-compile (``fused_adam`` for the ZeRO-3 FusedAdam
offload test, ``deepspeed_shm_comm`` for every DeepSpeed-initialised process on the CPU accelerator), in the
background while other tests run: on a fresh machine the two compiles take ~130 s that would otherwise sit in the
first test that needs them. The tests still build or load the ops themselves through DeepSpeed: a test that
arrives while a build is running waits on torch's build lock, then loads the result; nothing is skipped.

``python -m tests.deepspeed_ops`` builds them; ``start``/``stop`` run that from ``tests/conftest.py``."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

OPS = ("FusedAdamBuilder", "ShareMemCommBuilder")
NEEDED_BY = ("tests/integration/test_offload_deepspeed.py", "tests/integration/test_zero_memory_plan.py", "tests/grpo/")
REPO = Path(__file__).resolve().parents[1]


def wanted(nodeids: list[str]) -> bool:
    """Whether a session with these test ids will build the ops (DeepSpeed installed, CPU only, a test that needs
    them selected)."""
    if importlib.util.find_spec("deepspeed") is None or os.environ.get("RM_TEST_BUILD_DS_OPS_INLINE") == "1":
        return False
    import torch

    return not torch.cuda.is_available() and any(n.startswith(NEEDED_BY) for n in nodeids)


def start(log: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, "-m", "tests.deepspeed_ops"], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End the build if the session ends first (a small selection), and remove the build locks it held, so a later
    session neither waits on a dead build nor finds a stale lock."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for lock in _extension_dirs():
        (lock / "lock").unlink(missing_ok=True)


def _extension_dirs() -> list[Path]:
    from torch.utils.cpp_extension import _get_build_directory

    return [Path(_get_build_directory(name, verbose=False)) for name in ("fused_adam", "deepspeed_shm_comm")]


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            print(f"{name}: not available on this accelerator")
            continue
        builder.load(verbose=False)
        print(f"{name}: built")


if __name__ == "__main__":
    main()
