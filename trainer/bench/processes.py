"""The subprocesses benchmarks start (servers, learners, peers): each in a session of its own, so that stopping it
stops everything it started (torchrun's ranks, vLLM's workers); output appended to a log.

``stop_group`` continues a stopped group (a fault injection may have SIGSTOPped it), sends SIGTERM, then SIGKILL to
what is left after ``grace_s``, and returns once the group is empty: its GPU memory is free before the next
configuration starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def start_group(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
                append: bool = True) -> subprocess.Popen:
    """``argv`` in a new session, stdout and stderr to ``log`` (appended unless ``append`` is false), stdin closed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as fh:
        return subprocess.Popen([str(a) for a in argv], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, stdin=subprocess.DEVNULL)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal (should not happen): treat as alive
        return True
    return True


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """Stop the process group ``proc`` leads (see the module docstring); returns ``proc``'s exit code."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGCONT)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            proc.poll()  # reap the leader, or it stays a zombie member of the group
            if not group_alive(pgid):
                break
            time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(2)
    return proc.returncode
