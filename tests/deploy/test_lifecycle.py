"""Rollout-server lifecycle (``trainer supervise``): servers stop, releasing their GPUs, when the learner finishes.

Real processes: the learner and server supervisors run as ``python -m trainer.deploy.lifecycle`` subprocesses with
stand-in children (a server that records SIGTERM, a learner that exits with a chosen code).
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainer.deploy.lifecycle import child_argv
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

SERVER_CHILD = ("import signal, sys, time, pathlib\n"
                "p = pathlib.Path(sys.argv[1])\n"
                "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('SIGTERM'), sys.exit(0)))\n"
                "p.write_text('running')\n"
                "time.sleep(600)\n")  # until signalled; 600 s bounds an orphan only


def _learner(port: int, code: int, seconds: float = 1.0, *flags: str, gate: Path | None = None) -> subprocess.Popen:
    """A learner supervisor whose child exits with ``code`` after ``seconds``, or, with ``gate``, once that file
    exists (the test decides when the learner ends; 600 s bounds an orphan only)."""
    child = (f"import time, sys; time.sleep({seconds}); sys.exit({code})" if gate is None else
             f"import os, time, sys\nt = time.monotonic()\nwhile not os.path.exists({str(gate)!r}) and "
             f"time.monotonic() - t < 600:\n    time.sleep(0.05)\nsys.exit({code})")
    return subprocess.Popen([sys.executable, "-m", "trainer.deploy.lifecycle", "learner", "--control-port", str(port),
                             *flags, "--", sys.executable, "-c", child], stderr=subprocess.PIPE, text=True)


def _server(learner_port: int, marker, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.deploy.lifecycle", "server", "--learner-control",
                             f"http://127.0.0.1:{learner_port}", "--poll-s", "0.2", "--grace-s", "5", *flags,
                             "--", sys.executable, "-c", SERVER_CHILD, str(marker)],
                            stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout_s=120.0):
    """Poll ``predicate`` until true; ``timeout_s`` bounds a hang only (every wait here is for an event)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _finish(proc: subprocess.Popen, timeout_s: float = 120.0) -> tuple[int, str]:  # bounds a hang only
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"{proc.args[:5]} did not exit:\n{err}") from None
    return proc.returncode, err


def test_servers_stop_when_the_learner_succeeds(tmp_path):
    port = free_port()
    markers = [tmp_path / f"server-{i}" for i in range(2)]
    servers = [_server(port, m) for m in markers]
    assert _wait_for(lambda: all(m.exists() for m in markers))
    learner = _learner(port, 0, 1.5, "--expect-watchers", "2", "--linger-s", "120")  # ends once both read
    learner_code, learner_err = _finish(learner)
    assert learner_code == 0, learner_err
    assert "2/2 server(s) read the final state" in learner_err
    for server, marker in zip(servers, markers):
        code, err = _finish(server)
        assert code == 0, err
        assert marker.read_text() == "SIGTERM", "the server was not asked to stop"
        assert "learner succeeded (exit 0): stopping the server" in err


def test_a_final_learner_failure_stops_the_servers_and_keeps_its_exit_code(tmp_path):
    port = free_port()
    marker = tmp_path / "server"
    server = _server(port, marker)
    learner = _learner(port, 7, 1.0, "--final-on-failure", "--expect-watchers", "1", "--linger-s", "120")
    assert _finish(learner)[0] == 7
    code, err = _finish(server)
    assert code == 0 and marker.read_text() == "SIGTERM", err
    assert "learner failed (exit 7)" in err


def test_a_learner_failure_with_retries_left_keeps_the_servers_until_the_orphan_timeout(tmp_path):
    """The learner's endpoint is the supervisor's own (``LearnerState`` + ``control_server``) run in this process, so
    the test knows which states the server supervisor has read: a non-final failure read twice (the supervisor went
    on polling after the first) has not stopped the server; once the endpoint is gone, the orphan timeout does."""
    from trainer.deploy import lifecycle

    state = lifecycle.LearnerState(final_on_failure=False)
    reads: list[str] = []  # the state each of the server supervisor's polls was answered with
    snapshot = state.snapshot

    def recorded_snapshot():
        body = snapshot()
        reads.append(body["state"])
        return body

    state.snapshot = recorded_snapshot
    port = free_port()
    control = lifecycle.control_server(state, "127.0.0.1", port)
    marker = tmp_path / "server"
    server = _server(port, marker, "--orphan-timeout-s", "5")
    try:
        assert _wait_for(lambda: marker.exists() and "running" in reads), "the server never polled the learner"
        state.finish(1)  # a non-final learner failure: a retry follows
        first = len(reads)
        assert _wait_for(lambda: reads[first:].count("failed") >= 2), "the server stopped polling the learner"
        assert server.poll() is None, "a non-final learner failure (a retry follows) must not stop the servers"
    finally:
        control.shutdown()  # the learner is gone: unreachable from now on
        control.server_close()
    code, err = _finish(server)
    assert code == 0, err
    assert "unreachable for" in err and marker.read_text() == "SIGTERM"


def test_a_learner_that_never_appears_stops_the_server_after_the_orphan_timeout(tmp_path):
    marker = tmp_path / "server"
    code, err = _finish(_server(free_port(), marker, "--orphan-timeout-s", "1"))
    assert code == 0 and "not seen in" in err and marker.read_text() == "SIGTERM"


def test_a_crashing_server_passes_its_exit_code_through(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "trainer.deploy.lifecycle", "server", "--learner-control",
                             f"http://127.0.0.1:{free_port()}", "--poll-s", "0.2", "--",
                             sys.executable, "-c", "import sys; sys.exit(5)"], stderr=subprocess.PIPE, text=True)
    code, err = _finish(proc)
    assert code == 5, err  # a Job with restartPolicy OnFailure restarts it; the learner re-admits it


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has its SIGTERM handler installed (Linux: the SigCgt mask of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return True  # no procfs: fall back to the child's start (by then the supervisor has long installed it)
    mask = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def test_sigterm_reaches_the_supervised_server(tmp_path):
    marker = tmp_path / "server"
    server = _server(free_port(), marker)
    assert _wait_for(lambda: marker.exists() and _catches_sigterm(server.pid)), "supervisor or child did not start"
    server.send_signal(signal.SIGTERM)
    code, _ = _finish(server)
    assert code == 0 and marker.read_text() == "SIGTERM"


def test_the_control_endpoint_reports_running_then_the_final_state(tmp_path):
    port = free_port()
    gate = tmp_path / "learner-may-exit"
    learner = _learner(port, 0, 0, "--expect-watchers", "1", "--linger-s", "120", gate=gate)  # runs until the gate

    def status():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/lifecycle/?watcher=t", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError, http.client.HTTPException):  # the learner may go away mid-answer
            return None

    try:
        assert _wait_for(lambda: status() is not None)
        assert status()["state"] == "running" and status()["final"] is False
    finally:
        gate.touch()
    assert _wait_for(lambda: (status() or {}).get("state") == "succeeded")
    assert _finish(learner)[0] == 0


def test_a_taken_control_port_fails_fast():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = _finish(_learner(s.getsockname()[1], 0, 0.1))
    assert code == 3 and "cannot listen" in err


@pytest.mark.parametrize(("command", "expected"), [
    (["--", "launch", "server", "--port", "8000"], [sys.executable, "-m", "trainer", "launch", "server", "--port", "8000"]),
    (["swift", "rollout", "--model", "/m"], ["swift", "rollout", "--model", "/m"]),
])
def test_child_command(command, expected):
    assert child_argv(command) == expected


def test_no_command_is_an_error():
    with pytest.raises(ValueError, match="no command to supervise"):
        child_argv(["--"])


def test_a_learner_that_drops_the_connection_mid_answer_reads_as_not_answering():
    """The learner's endpoint going away mid-response (``IncompleteRead``, seen in CI while the learner shut down)
    must read as "not answering", not crash the server supervisor and leave its server running."""
    import socket
    import threading

    from trainer.deploy.lifecycle import learner_status

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer_half():
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 98\r\n\r\n{\"state\"")
        conn.close()

    t = threading.Thread(target=answer_half)
    t.start()
    assert learner_status(f"http://127.0.0.1:{srv.getsockname()[1]}", "w") is None
    t.join(5)
    srv.close()


def test_a_watcher_counts_as_having_read_the_final_state_only_after_its_answer_was_written(monkeypatch):
    """The learner exits once the expected watchers have read the final state; counting a watcher before its answer
    was written let the learner exit mid-answer (CI: the watcher never saw ``succeeded``)."""
    from trainer.deploy import lifecycle

    state = lifecycle.LearnerState(final_on_failure=False)
    state.finish(0)
    assert state.snapshot()["final"] and not state.watchers_done  # reading alone marks nothing
    order = []
    real_mark = state.mark_read
    monkeypatch.setattr(state, "mark_read", lambda w: (order.append(("marked", w)), real_mark(w)))
    port = free_port()
    server = lifecycle.control_server(state, "127.0.0.1", port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lifecycle/?watcher=w1", timeout=5) as r:
            body = json.loads(r.read())
        order.append(("read", body["state"]))
        with state.changed:  # marked by the server thread once the answer was written (60 s bounds a hang only)
            state.changed.wait_for(lambda: "w1" in state.watchers_done, timeout=60)
        assert body["state"] == "succeeded" and state.watchers_done == {"w1"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lifecycle/", timeout=5) as r:  # no watcher id
            assert json.loads(r.read())["final"] is True
        assert state.watchers_done == {"w1"} and order.count(("marked", "w1")) == 1
    finally:
        server.shutdown()


def test_signals_are_forwarded_only_while_the_child_is_supervised():
    """``forwarding_signals``: inside, SIGTERM goes to the child (and to ``on_signal``); afterwards the previous handler
    is back, so a process forked later from the supervisor does not inherit a handler that forwards to a dead child."""
    from trainer.deploy.lifecycle import forwarding_signals

    class _Child:
        def __init__(self):
            self.got: list[int] = []

        def signal(self, signum):
            self.got.append(signum)

    child, seen = _Child(), []
    guarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {sig: signal.getsignal(sig) for sig in guarded}
    with forwarding_signals(child, seen.append):
        assert all(signal.getsignal(sig) is not before[sig] for sig in guarded)
        signal.raise_signal(signal.SIGTERM)
    assert child.got == [signal.SIGTERM] and seen == [signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in guarded} == before
