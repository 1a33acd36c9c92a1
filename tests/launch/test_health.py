"""The learner's health check against real HTTP servers: the stub rollout server (healthy, slow to start),
a port nobody listens on and a server that answers 503 (never healthy), with one deadline for all."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.launch.conftest import free_port
from trainer.launch.health import ServersNotHealthyError, health_url, process_exited, wait_until_healthy


def test_health_url():
    assert health_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/health/"


def test_slow_to_start_then_healthy(scripted_server):
    """The server process is started only after the first probe was refused: polled through refusals, then healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs, sleeps = [], []

    def sleep(s):  # between rounds: the first one starts the server (still importing and binding for a while)
        sleeps.append(s)
        if not procs:
            procs.append(scripted_server(port)[1])
        time.sleep(s)

    log: list[str] = []
    took = wait_until_healthy([url], timeout_s=600, interval_s=0.2, log=log.append, sleep=sleep,  # 600 s: a hang
                              abort=lambda: process_exited(procs[0])() if procs else None)
    assert procs and procs[0].poll() is None
    assert len(sleeps) >= 1 and took[url] > 0
    assert log == [f"{url} healthy after {took[url]:.1f}s"]
    again = []
    wait_until_healthy([url], timeout_s=600, interval_s=0.2, request_timeout_s=60, sleep=again.append)
    assert again == [], "an already healthy server must pass on the first probe, without a second round"


class VirtualClock:
    """``clock``/``sleep`` for ``wait_until_healthy``: sleeping advances the clock, so deadlines are exact."""

    def __init__(self):
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def test_never_healthy_nothing_listening():
    url = f"http://127.0.0.1:{free_port()}"
    clock = VirtualClock()
    with pytest.raises(ServersNotHealthyError) as exc:
        wait_until_healthy([url], timeout_s=1.5, interval_s=0.3, clock=clock, sleep=clock.sleep)
    assert clock.t == pytest.approx(1.5) and clock.sleeps == pytest.approx([0.3] * 5), "polled until the deadline"
    assert list(exc.value.failures) == [url] and "ConnectError" in exc.value.failures[url]
    assert url in str(exc.value) and "1.5s" in str(exc.value)


class _Uvicorn:
    """A FastAPI app on a background thread; ``status`` is what GET /health/ answers."""

    def __init__(self, status: int):
        app = FastAPI()

        @app.get("/health/")
        def health():
            return JSONResponse({"status": "starting"}, status_code=self.status)

        self.status = status
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 120  # bounds a hang only: an in-process uvicorn starts in milliseconds
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "test server did not start within 120s"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_never_healthy_503_and_mixed_servers(scripted_server):
    good, proc = scripted_server()
    wait_until_healthy([good], timeout_s=600, interval_s=0.2, abort=process_exited(proc))  # 600 s: a hang only
    with _Uvicorn(503) as srv:
        bad = srv.url
        clock = VirtualClock()
        with pytest.raises(ServersNotHealthyError) as exc:
            wait_until_healthy([good, bad], timeout_s=1.5, interval_s=0.2, request_timeout_s=60, clock=clock,
                               sleep=clock.sleep)
    assert list(exc.value.failures) == [bad]  # only the unhealthy server is named
    assert exc.value.failures[bad] == "HTTP 503"


def test_unhealthy_server_recovering_before_deadline():
    with _Uvicorn(503) as srv:
        clock = VirtualClock()

        def sleep(s):  # the server recovers after the wait's third round answered 503
            clock.sleep(s)
            if len(clock.sleeps) == 3:
                srv.status = 200

        took = wait_until_healthy([srv.url], timeout_s=15, interval_s=0.2, request_timeout_s=60, clock=clock,
                                  sleep=sleep)
    assert clock.sleeps == pytest.approx([0.2] * 3) and took[srv.url] == pytest.approx(0.6)


def test_dead_server_process_stops_the_wait_with_its_output():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('bad flag --xyz'); sys.exit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    exited_at_sleep = []

    def sleep(s):  # records whether the process had exited when the wait went for another round
        exited_at_sleep.append(proc.poll() is not None)
        time.sleep(s)

    with pytest.raises(RuntimeError, match=r"exited with code 3: bad flag --xyz"):
        wait_until_healthy([f"http://127.0.0.1:{free_port()}"], timeout_s=600, interval_s=0.1,
                           abort=process_exited(proc), sleep=sleep)
    assert sum(exited_at_sleep) <= 1, "the wait went on after the process exited (it must stop at the next round)"
