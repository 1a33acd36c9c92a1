"""The HTTP client every learner-side call to a rollout server goes through (``/infer/``, weight pushes, probes).

Contract: an idle pooled connection is dropped after ``KEEPALIVE_EXPIRY_S`` (2 s), below the 5 s keep-alive timeout
of uvicorn (ms-swift's ``swift rollout``) and of our ``serve`` (30 s). With the client keeping connections as long
as the server (httpx and uvicorn both default to 5 s) a request sent on a connection the server is closing at that
moment fails with "Server disconnected without sending a response", which quarantines a healthy server; seen with
learner steps of about 5 s.
"""

from __future__ import annotations

import httpx

KEEPALIVE_EXPIRY_S = 2.0


def server_http_client(timeout_s: float) -> httpx.Client:
    """An ``httpx.Client`` for rollout servers whose idle connections expire before any server closes them."""
    return httpx.Client(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
