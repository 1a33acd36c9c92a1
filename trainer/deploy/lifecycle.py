"""Rollout-server lifecycle: the servers release their GPUs when the learner finishes.

Two small supervisors, each running the real command as its child (stdlib only, so they work the same in a
Kubernetes pod, under ``docker run`` and on bare metal):

``python -m trainer supervise learner --control-port P [--final-on-failure] -- launch learner …``
    runs the learner and answers ``GET http://127.0.0.1:P/lifecycle/`` with its state: ``running`` while the
    learner runs, then ``succeeded`` or ``failed`` (``final: true`` when no retry will follow: a success, or a
    failure with ``--final-on-failure``, i.e. ``backoffLimit: 0``). After the learner exits it keeps answering
    until ``--expect-watchers`` servers have read the final state (or ``--linger-s`` passes), then exits with the
    learner's exit code.

``python -m trainer supervise server --learner-control http://127.0.0.1:P [--orphan-timeout-s S] -- launch server …``
    runs the server and polls the learner's endpoint. A final state stops the server (SIGTERM to its process
    group, SIGKILL after ``--grace-s``) and exits 0, so a Kubernetes Job completes and its GPUs are released. A
    learner that was seen and then stays unreachable for ``--orphan-timeout-s`` (killed, evicted, deadline), or
    that never appears within that time, also stops the server. A server that exits on its own passes its exit
    code through (non-zero: the Job restarts it; the learner re-admits it); 75 is ``python -m trainer serve``'s
    "engine died, restart me" (``trainer.server.fatal.EXIT_ENGINE_DEAD``), and is reported so.

Arguments after ``--`` starting with a ``python -m trainer`` subcommand (``launch``, ``serve``, ``train``) run as
``python -m trainer …``; anything else runs as given (``-- swift rollout …``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

LIFECYCLE_PATH = "/lifecycle/"
TRAINER_SUBCOMMANDS = ("launch", "serve", "train", "validate")
RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


def _say(role: str, msg: str) -> None:
    print(f"supervise {role}: {msg}", file=sys.stderr, flush=True)


def child_argv(command: Sequence[str]) -> list[str]:
    """The child's argv: ``python -m trainer …`` for a trainer subcommand, else the command as given."""
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("no command to supervise: put it after --, e.g. -- launch server --engine vllm …")
    if command[0] in TRAINER_SUBCOMMANDS:
        return [sys.executable, "-m", "trainer", *command]
    return command


class _Child:
    """The supervised process in its own process group; signals reach the whole group (e.g. swift's DP workers)."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float) -> int:
        """SIGTERM the group, SIGKILL it after ``grace_s``; returns the child's exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        return self.proc.wait()


@contextlib.contextmanager
def forwarding_signals(child: _Child, on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP go to ``child`` while the block runs; the previous handlers are back afterwards
    (a handler left installed outlived its child: a later process forked from this one, e.g. a multiprocessing
    worker, then forwarded its own SIGTERM to the dead child instead of stopping)."""
    def handler(signum, _frame):
        if on_signal is not None:
            on_signal(signum)
        child.signal(signum)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class LearnerState:
    """What ``GET /lifecycle/`` answers, and which watchers have read a final state."""

    def __init__(self, final_on_failure: bool):
        self.final_on_failure = final_on_failure
        self.lock = threading.Lock()
        self.state = RUNNING
        self.exit_code: int | None = None
        self.started_at = time.time()
        self.watchers_done: set[str] = set()
        self.changed = threading.Condition(self.lock)

    def finish(self, exit_code: int) -> None:
        with self.lock:
            self.exit_code = exit_code
            self.state = SUCCEEDED if exit_code == 0 else FAILED
            self.changed.notify_all()

    @property
    def final(self) -> bool:
        return self.state == SUCCEEDED or (self.state == FAILED and self.final_on_failure)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"state": self.state, "final": self.final, "exit_code": self.exit_code,
                    "started_at": self.started_at, "pid": os.getpid()}

    def mark_read(self, watcher: str) -> None:
        """``watcher`` has been sent a final state in full (counted only after the answer was written, so the learner
        cannot exit while that answer is still on its way)."""
        with self.lock:
            self.watchers_done.add(watcher)
            self.changed.notify_all()


def control_server(state: LearnerState, host: str, port: int) -> ThreadingHTTPServer:
    """The learner's control endpoint (loopback, no body accepted, ``GET /lifecycle/`` and ``/health/`` only)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            parts = urlsplit(self.path)
            if parts.path.rstrip("/") == LIFECYCLE_PATH.rstrip("/"):
                watcher = (parse_qs(parts.query).get("watcher") or [None])[0]
                body = state.snapshot()
                self._json(200, body)
                if body["final"] and watcher:
                    state.mark_read(watcher)
            elif parts.path.rstrip("/") == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"detail": f"not found: {parts.path}"})

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="lifecycle-control", daemon=True).start()
    return server


def supervise_learner(command: Sequence[str], port: int, host: str = "127.0.0.1", final_on_failure: bool = False,
                      expect_watchers: int = 0, linger_s: float = 30.0) -> int:
    state = LearnerState(final_on_failure)
    try:
        server = control_server(state, host, port)
    except OSError as exc:
        _say("learner", f"cannot listen on {host}:{port} for the lifecycle endpoint ({exc}); another process holds "
                        "the port: stop it, or change ports.base in the chart values")
        return 3
    _say("learner", f"lifecycle endpoint http://{host}:{port}{LIFECYCLE_PATH}; running {' '.join(child_argv(command))}")
    child = _Child(child_argv(command))
    with forwarding_signals(child):
        code = child.proc.wait()
    state.finish(code)
    _say("learner", f"learner exited with {code}: state {state.state}, final={state.final}")
    if state.final and expect_watchers > 0:
        deadline = time.monotonic() + linger_s
        with state.lock:
            while len(state.watchers_done) < expect_watchers and time.monotonic() < deadline:
                state.changed.wait(max(0.0, deadline - time.monotonic()))
            seen = len(state.watchers_done)
        _say("learner", f"{seen}/{expect_watchers} server(s) read the final state")
    elif state.final:
        time.sleep(min(linger_s, 1.0))
    server.shutdown()
    return code


def learner_status(url: str, watcher: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """The learner's lifecycle state, or ``None`` when it does not answer (also when it goes away mid-answer: an
    ``http.client.IncompleteRead`` while the learner shuts down once crashed the server supervisor)."""
    query = "?" + urlencode({"watcher": watcher})
    try:
        with urllib.request.urlopen(url.rstrip("/") + LIFECYCLE_PATH + query, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())
    except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException):
        return None


def server_exit_reason(code: int) -> str:
    """What a rollout server's exit code means, for the supervisor's log line (empty when nothing to add)."""
    from trainer.server.fatal import EXIT_ENGINE_DEAD  # imports torch: not at import, so render-job needs none

    if code == EXIT_ENGINE_DEAD:
        return (f": its engine died (exit {EXIT_ENGINE_DEAD}, trainer.server.fatal); exiting with it so the server is "
                "restarted fresh (Job restartPolicy OnFailure) and the learner re-admits it with the current weights")
    return ""


def supervise_server(command: Sequence[str], learner_url: str, poll_s: float = 5.0, orphan_timeout_s: float = 1800.0,
                     grace_s: float = 30.0, watcher: str | None = None,
                     clock: Callable[[], float] = time.monotonic) -> int:
    # host:pid alone is not unique: servers under host networking share the node's hostname, and each container's
    # PID namespace numbers its processes alike (the 3v1 Docker test saw 2/3 watchers), so add a random part
    watcher = watcher or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    _say("server", f"running {' '.join(child_argv(command))}; stops when the learner at {learner_url} finishes")
    child = _Child(child_argv(command))
    signalled: list[int] = []
    with forwarding_signals(child, signalled.append):
        started = last_seen = clock()
        seen = False
        while True:
            code = child.poll()
            if code is not None:
                _say("server", f"server exited with {code}" + (" (signalled)" if signalled else "")
                     + server_exit_reason(code))
                return code
            status = learner_status(learner_url, watcher)
            now = clock()
            if status is not None:
                seen, last_seen = True, now
                if status.get("final"):
                    _say("server", f"learner {status.get('state')} (exit {status.get('exit_code')}): stopping the server "
                                   "to release its GPUs")
                    code = child.stop(grace_s)
                    _say("server", f"server stopped (exit {code})")
                    return 0
            elif orphan_timeout_s > 0 and now - last_seen > orphan_timeout_s:
                why = (f"unreachable for {now - last_seen:.0f}s after it was seen" if seen
                       else f"not seen in {now - started:.0f}s")
                _say("server", f"learner {why} (orphan timeout {orphan_timeout_s:g}s): stopping the server")
                child.stop(grace_s)
                return 0
            deadline = time.monotonic() + poll_s
            while time.monotonic() < deadline and child.poll() is None:
                time.sleep(min(0.2, poll_s))


def _nonneg(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _run(fn: Callable[..., int], *args: Any) -> int:
    try:
        return fn(*args)
    except ValueError as exc:
        print(f"supervise: {exc}", file=sys.stderr)
        return 2


def add_roles(sub: argparse._SubParsersAction) -> None:
    """``learner`` and ``server`` sub-commands (shared by ``python -m trainer supervise`` and this module's main)."""
    learner = sub.add_parser("learner", help="run the learner and publish its state on a loopback control port")
    learner.add_argument("--control-port", type=int, required=True)
    learner.add_argument("--host", default="127.0.0.1")
    learner.add_argument("--final-on-failure", action="store_true",
                         help="a failed learner is final (no retry follows, e.g. Job backoffLimit 0): servers stop")
    learner.add_argument("--expect-watchers", type=int, default=0,
                         help="after the learner exits, wait until this many servers read the final state")
    learner.add_argument("--linger-s", type=_nonneg, default=30.0, help="longest wait for them (default 30)")
    learner.add_argument("command", nargs=argparse.REMAINDER, help="-- the learner command")
    learner.set_defaults(func=lambda a: _run(supervise_learner, a.command, a.control_port, a.host,
                                             a.final_on_failure, a.expect_watchers, a.linger_s))
    server = sub.add_parser("server", help="run a rollout server until the learner finishes")
    server.add_argument("--learner-control", required=True, metavar="URL", help="the learner's control base URL")
    server.add_argument("--poll-s", type=_nonneg, default=5.0)
    server.add_argument("--orphan-timeout-s", type=_nonneg, default=1800.0,
                        help="stop when the learner is unreachable this long (0: never; default 1800)")
    server.add_argument("--grace-s", type=_nonneg, default=30.0, help="SIGTERM → SIGKILL grace (default 30)")
    server.add_argument("--watcher", help="name reported to the learner (default host:pid:random, unique per supervisor)")
    server.add_argument("command", nargs=argparse.REMAINDER, help="-- the server command")
    server.set_defaults(func=lambda a: _run(supervise_server, a.command, a.learner_control, a.poll_s,
                                            a.orphan_timeout_s, a.grace_s, a.watcher))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("supervise", help="run a learner or rollout server so servers stop when the learner ends",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="supervise_what", metavar="{learner,server}")
    sub.required = True
    add_roles(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.deploy.lifecycle", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="supervise_what", metavar="{learner,server}")
    sub.required = True
    add_roles(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
