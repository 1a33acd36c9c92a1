"""The subprocesses benchmarks start (servers, learners, peers): each in a session of its own, so that stopping it
stops everything it started (torchrun's ranks, vLLM's workers); output appended to a log.

``stop_group`` continues a stopped group (a fault injection may have SIGSTOPped it), sends SIGTERM, then SIGKILL to
what is left after ``grace_s``, and returns once the group is empty: its GPU memory is free before the next
configuration starts.

A bench stopped from outside (``timeout``'s SIGTERM, a hang-up) stops every group it started before it exits: while
any group it started is live, SIGTERM/SIGHUP raise ``SystemExit`` (where the default action would kill the process
outright), and ``stop_all_groups`` runs at exit, so no learner or vLLM server outlives its bench holding GPU memory
(a later configuration would fail to start for want of it). The handlers go in with the first live group (on the
main thread, only over the default action) and the previous ones come back when the last live group is stopped: a
long-lived process that used ``start_group`` once (a test run) keeps its own signal handling."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

#: process groups started and not yet stopped, by leader pid
_LIVE: dict[int, subprocess.Popen] = {}
_atexit_registered = False
#: the handlers ``_exit_on_signal`` replaced while groups are live, by signal
_REPLACED: dict[int, object] = {}


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _install_exit_hooks() -> None:
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(stop_all_groups)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                _REPLACED[sig] = signal.signal(sig, _exit_on_signal)


def _restore_signal_handlers() -> None:
    """Put back what ``_install_exit_hooks`` replaced, where its handler is still the one installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_REPLACED.items()):
        if signal.getsignal(sig) is _exit_on_signal:
            signal.signal(sig, previous)
        del _REPLACED[sig]


def live_groups() -> list[int]:
    """Leader pids of the groups started here and not yet stopped."""
    return list(_LIVE)


def stop_all_groups(grace_s: float = 5.0) -> None:
    """Stop every group ``start_group`` started that is still registered (at exit, or after a bench was stopped)."""
    for proc in list(_LIVE.values()):
        stop_group(proc, grace_s=grace_s)


def start_group(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
                append: bool = True) -> subprocess.Popen:
    """``argv`` in a new session, stdout and stderr to ``log`` (appended unless ``append`` is false), stdin closed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    for pid, earlier in list(_LIVE.items()):  # groups that ended on their own, never stopped
        if earlier.poll() is not None and not group_alive(pid):
            del _LIVE[pid]
    _install_exit_hooks()
    with log.open("ab" if append else "wb") as fh:
        proc = subprocess.Popen([str(a) for a in argv], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    _LIVE[proc.pid] = proc
    return proc


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
    _LIVE.pop(pgid, None)
    if not _LIVE:
        _restore_signal_handlers()
    return proc.returncode
