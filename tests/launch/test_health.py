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
from trainer.launch.health import ServersNotHealthyError, health_url, wait_until_healthy


def test_health_url():
    assert health_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/health/"


def test_slow_to_start_then_healthy(scripted_server):
    url, proc = scripted_server()  # the server needs seconds to import and bind: polled through refusals
    log: list[str] = []
    t0 = time.monotonic()
    took = wait_until_healthy([url], timeout_s=90, interval_s=0.2, log=log.append)
    assert proc.poll() is None
    assert took[url] > 0.5 and time.monotonic() - t0 < 90
    assert log == [f"{url} healthy after {took[url]:.1f}s"]
    again = wait_until_healthy([url], timeout_s=5, interval_s=0.2)  # already healthy: immediate
    assert again[url] < 1.0


def test_never_healthy_nothing_listening():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServersNotHealthyError) as exc:
        wait_until_healthy([url], timeout_s=1.5, interval_s=0.3)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 5
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
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_never_healthy_503_and_mixed_servers(scripted_server):
    good, _ = scripted_server()
    wait_until_healthy([good], timeout_s=90, interval_s=0.2)
    with _Uvicorn(503) as srv:
        bad = srv.url
        with pytest.raises(ServersNotHealthyError) as exc:
            wait_until_healthy([good, bad], timeout_s=1.5, interval_s=0.2)
    assert list(exc.value.failures) == [bad]  # only the unhealthy server is named
    assert exc.value.failures[bad] == "HTTP 503"


def test_unhealthy_server_recovering_before_deadline():
    with _Uvicorn(503) as srv:
        threading.Timer(1.0, lambda: setattr(srv, "status", 200)).start()
        took = wait_until_healthy([srv.url], timeout_s=15, interval_s=0.2)
    assert 1.0 <= took[srv.url] < 15


def test_dead_server_process_stops_the_wait_with_its_output():
    import subprocess
    import sys

    from trainer.launch.health import process_exited

    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('bad flag --xyz'); sys.exit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with code 3: bad flag --xyz"):
        wait_until_healthy([f"http://127.0.0.1:{free_port()}"], timeout_s=60, interval_s=0.1,
                           abort=process_exited(proc))
    assert time.monotonic() - t0 < 30, "did not wait for the deadline"
