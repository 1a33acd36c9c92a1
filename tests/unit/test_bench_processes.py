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
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("started", flush=True)
time.sleep(600)
"""


def _wait_for(log, text, timeout_s=30.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if log.is_file() and text in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {log}")


def test_stop_group_ends_a_stopped_group_that_ignores_sigterm(tmp_path):
    log = tmp_path / "child.log"
    proc = start_group([sys.executable, "-c", CHILD], log)
    _wait_for(log, "started")
    os.killpg(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    rc = stop_group(proc, grace_s=5.0)  # the reaper of the orphaned grandchild (PID 1) may take seconds
    assert not group_alive(proc.pid), "grandchild left behind"
    assert rc == -signal.SIGKILL and time.monotonic() - t0 < 15


def test_start_group_appends_to_the_log(tmp_path):
    log = tmp_path / "out.log"
    log.write_text("before\n")
    proc = start_group([sys.executable, "-c", "print('after')"], log)
    proc.wait(30)
    assert log.read_text() == "before\nafter\n"
    proc = start_group([sys.executable, "-c", "print('fresh')"], log, append=False)
    proc.wait(30)
    assert log.read_text() == "fresh\n"
