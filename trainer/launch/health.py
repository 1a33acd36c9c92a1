"""Wait until rollout servers answer ``GET /health/`` with 200, with one deadline for all of them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import httpx

HEALTH_PATH = "/health/"


class ServersNotHealthyError(RuntimeError):
    def __init__(self, failures: dict[str, str], timeout_s: float):
        self.failures = failures
        detail = "; ".join(f"{url}: {why}" for url, why in failures.items())
        super().__init__(f"{len(failures)} rollout server(s) not healthy after {timeout_s:g}s: {detail}. "
                         "Check that each server was launched (python -m trainer launch server …), its logs, "
                         "and that host/port match the learner config")


def health_url(base_url: str) -> str:
    return base_url.rstrip("/") + HEALTH_PATH


def probe(client: httpx.Client, base_url: str) -> str | None:
    """``None`` when healthy, else why not (connection error or status)."""
    try:
        r = client.get(health_url(base_url))
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def wait_until_healthy(base_urls: Sequence[str], timeout_s: float, interval_s: float = 1.0,
                       request_timeout_s: float = 5.0, log: Callable[[str], None] | None = None,
                       clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep,
                       abort: Callable[[], str | None] | None = None) -> dict[str, float]:
    """Poll until every server is healthy; return seconds each took. Raises ``ServersNotHealthyError`` listing
    the servers still unhealthy at the deadline (with the last reason for each). ``abort`` (e.g. "the server
    process exited") is asked between rounds; a reason from it raises ``RuntimeError`` at once."""
    start = clock()
    deadline = start + timeout_s
    pending = {u: "not probed yet" for u in dict.fromkeys(base_urls)}
    ready: dict[str, float] = {}
    with httpx.Client(timeout=request_timeout_s, trust_env=False) as client:
        while True:
            for url in list(pending):
                why = probe(client, url)
                if why is None:
                    ready[url] = clock() - start
                    del pending[url]
                    if log:
                        log(f"{url} healthy after {ready[url]:.1f}s")
                else:
                    pending[url] = why
            if not pending:
                return ready
            why_stop = abort() if abort else None
            if why_stop:
                raise RuntimeError(f"waiting for {sorted(pending)} to become healthy stopped: {why_stop}")
            now = clock()
            if now >= deadline:
                raise ServersNotHealthyError(pending, timeout_s)
            sleep(min(interval_s, max(deadline - now, 0.0)))


def process_exited(proc: subprocess.Popen, output: Callable[[], str] | None = None) -> Callable[[], str | None]:
    """An ``abort`` for ``wait_until_healthy``: once ``proc`` has exited, its exit code and the tail of its output
    (``output()``, else its stdout pipe)."""

    def check() -> str | None:
        if proc.poll() is None:
            return None
        text = output() if output else (proc.stdout.read().decode(errors="replace") if proc.stdout else "")
        return f"server process exited with code {proc.returncode}: {text[-3000:]}"

    return check


@contextlib.contextmanager
def serve_subprocess(*args: str, port: int | None = None, env: dict[str, str] | None = None,
                     timeout_s: float = 120.0, interval_s: float = 0.2) -> Iterator[tuple[str, subprocess.Popen, float]]:
    """``python -m trainer serve --host 127.0.0.1 --port <port> --log-level warning <args>`` as a subprocess (``env``
    over this process's; a free port unless given); yields ``(base_url, process, seconds to healthy)`` once it
    answers ``/health/`` (its output is in the error when it exits first); terminated (killed if it lingers) at
    the end."""
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", *args],
                            env={**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT)

    def output() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    url = f"http://127.0.0.1:{port}"
    try:
        took = wait_until_healthy([url], timeout_s, interval_s=interval_s, abort=process_exited(proc, output))[url]
        yield url, proc, took
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(10)
        log.close()
