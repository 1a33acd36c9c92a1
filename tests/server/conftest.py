"""Run rollout servers for real: an app under uvicorn on a free loopback port in a background thread, or
``python -m trainer serve`` as a subprocess."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from trainer.launch.ports import listen_port as free_port  # below the ephemeral range


@contextlib.contextmanager
def serve_app(app, port: int | None = None):
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # bounds a hang only: an in-process uvicorn starts in milliseconds
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn on 127.0.0.1:{port} did not start within 120s (thread alive: "
                               f"{thread.is_alive()})")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_process(port: int, *args: str, env: dict[str, str] | None = None, timeout_s: float = 600):
    """``trainer.launch.health.serve_subprocess`` on ``port``; yields ``(base_url, process)``. ``timeout_s`` bounds a
    hang only (a server process that exits fails the wait at once, with its output)."""
    from trainer.launch.health import serve_subprocess

    with serve_subprocess(*args, port=port, env=env, timeout_s=timeout_s) as (url, proc, _):
        yield url, proc


@contextlib.contextmanager
def _scripted_server(model_dir=None, api_key=None, port=None, stalled=False, **engine_kwargs):
    from tests.server.stall import Stall
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    engine = ScriptedEngine(model_dir, **engine_kwargs)
    app = create_app(engine, api_key)
    if stalled:  # every /infer/ hangs until released (tests/server/stall.py): by the test or the next request
        engine.stall = Stall(engine)
        app = engine.stall.app(app)
    with serve_app(app, port) as url:
        try:
            yield url, engine
        finally:  # before the server shuts down: it waits for the requests in flight
            if stalled:
                engine.stall.release()


@pytest.fixture(scope="session")
def scripted_server():
    """``scripted_server(model_dir=None, api_key=None, port=None, stalled=False, **engine_kwargs)`` → context manager
    yielding ``(base_url, engine)``; ``stalled``: ``engine.stall`` is a ``tests.server.stall.Stall`` on every call."""
    return _scripted_server


@pytest.fixture(scope="session")
def trainer_serve():
    """``trainer_serve(port, *args, env=None, timeout_s=600)`` → context manager yielding ``(base_url, process)``
    of a ``python -m trainer serve`` subprocess (``serve_process``)."""
    return serve_process


@pytest.fixture(scope="session")
def serve():
    """``serve(app, port=None)`` → context manager yielding the base URL."""
    return serve_app


@pytest.fixture(scope="session")
def get_free_port():
    return free_port


@pytest.fixture
def http():
    with httpx.Client(timeout=30) as client:
        yield client
