"""Wait until rollout servers answer ``GET /health/`` with 200, with one deadline for all of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
                       sleep: Callable[[float], None] = time.sleep) -> dict[str, float]:
    """Poll until every server is healthy; return seconds each took. Raises ``ServersNotHealthyError`` listing
    the servers still unhealthy at the deadline (with the last reason for each)."""
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
            now = clock()
            if now >= deadline:
                raise ServersNotHealthyError(pending, timeout_s)
            sleep(min(interval_s, max(deadline - now, 0.0)))
