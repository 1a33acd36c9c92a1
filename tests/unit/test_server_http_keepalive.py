"""The learner's HTTP client drops idle connections before any rollout server closes them (``trainer.sync.http``):
otherwise a request sent as the server closes an idle keep-alive connection fails with "Server disconnected
without sending a response" and a healthy server is quarantined."""

from __future__ import annotations

import inspect

import uvicorn

from trainer.server.cli import KEEPALIVE_S
from trainer.sync.http import KEEPALIVE_EXPIRY_S, server_http_client


def test_client_idle_expiry_is_below_every_server_keepalive():
    uvicorn_default = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default  # swift rollout's
    assert KEEPALIVE_EXPIRY_S < uvicorn_default < KEEPALIVE_S
    with server_http_client(5.0) as client:
        assert client._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY_S


def test_every_learner_side_client_uses_it():
    from trainer.rollout import server_client, server_fleet
    from trainer.sync import transports

    for module in (server_client, server_fleet, transports):
        source = inspect.getsource(module)
        assert "httpx.Client(" not in source and "server_http_client(" in source, module.__name__
