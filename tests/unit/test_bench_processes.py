"""``trainer.bench.processes``: one way the benchmarks start and stop their subprocesses. A stopped group (a fault
injection's SIGSTOP) and a child that ignores SIGTERM are both gone, grandchildren included, when ``stop_group``
returns."""

from __future__ import annotations

import os
import signal
import sys
import time

from trainer.bench.processes import group_alive, start_group, stop_group

CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("started", grandchild.pid, flush=True)
time.sleep(600)
"""


def _wait_for(log, text, timeout_s=30.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if log.is_file() and text in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {log}")


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_group_ends_a_stopped_group_that_ignores_sigterm(tmp_path):
    log = tmp_path / "child.log"
    proc = start_group([sys.executable, "-c", CHILD], log)
    _wait_for(log, "started")
    grandchild = int(log.read_text().split("started", 1)[1].split()[0])
    assert _alive(grandchild)
    os.killpg(proc.pid, signal.SIGSTOP)
    rc = stop_group(proc, grace_s=5.0)  # the reaper of the orphaned grandchild (PID 1) may take seconds
    assert rc == -signal.SIGKILL, "SIGTERM is ignored: the return reports the SIGKILL that ended the leader"
    assert proc.returncode == rc, "the leader was reaped (no zombie left for the caller)"
    assert not group_alive(proc.pid), "a member of the group (the grandchild) was left behind"
    assert not _alive(grandchild), "the grandchild is gone, not a zombie"


def test_start_group_appends_to_the_log(tmp_path):
    log = tmp_path / "out.log"
    log.write_text("before\n")
    proc = start_group([sys.executable, "-c", "print('after')"], log)
    proc.wait(30)
    stop_group(proc)
    assert log.read_text() == "before\nafter\n"
    proc = start_group([sys.executable, "-c", "print('fresh')"], log, append=False)
    proc.wait(30)
    stop_group(proc)
    assert log.read_text() == "fresh\n"


BENCH = """
import sys, time
from pathlib import Path
from trainer.bench.processes import start_group
proc = start_group([sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]) / "server.log")
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_bench_stopped_from_outside_stops_the_groups_it_started(tmp_path):
    """``timeout``'s SIGTERM to a bench: the server group it started is gone when the bench has exited (it used to
    outlive it and hold its GPU memory, so the next configuration failed to start)."""
    import subprocess

    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    assert group_alive(child)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(120) == 128 + signal.SIGTERM  # (a hang guard: the bench exits at once)
    # the bench stops the group, and waits for it to be empty, before it exits
    assert not group_alive(child), "the server group outlived its bench"


def test_stop_group_forgets_the_group(tmp_path):
    from trainer.bench.processes import live_groups

    proc = start_group([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "s.log")
    assert proc.pid in live_groups()
    stop_group(proc, grace_s=5.0)
    assert proc.pid not in live_groups()


def test_the_exit_on_signal_hook_lives_only_while_a_group_does(tmp_path):
    """SIGTERM raises ``SystemExit`` while a started group is live (so the bench stops it on the way out); once the
    last group is stopped the process's own handlers are back (a test run once kept the hook for good, and a forked
    pool worker later raised ``SystemExit`` on its pool's SIGTERM instead of ending)."""
    from trainer.bench import processes

    before = signal.getsignal(signal.SIGTERM)
    assert before is signal.SIG_DFL, "the test suite restores the default between tests"
    hangup = signal.getsignal(signal.SIGHUP)  # SIG_IGN under nohup: left as it is
    first = start_group([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "a.log")
    second = start_group([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "b.log")
    assert signal.getsignal(signal.SIGTERM) is processes._exit_on_signal
    stop_group(first, grace_s=5.0)
    assert signal.getsignal(signal.SIGTERM) is processes._exit_on_signal, "one group is still live"
    stop_group(second, grace_s=5.0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) is hangup
