"""Port checks: a free port passes; a port with a listener fails with a message naming the port and holder."""

from __future__ import annotations

import os
import socket

import pytest

from tests.launch.conftest import free_port
from trainer.launch.ports import PortInUseError, ensure_port_free, port_holder, port_is_free


def test_free_port_is_free():
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    ensure_port_free("127.0.0.1", port)


def test_listening_port_is_taken_and_holder_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        holder = port_holder(port)
        assert holder is not None and holder.startswith(f"pid {os.getpid()} ")
        with pytest.raises(PortInUseError) as exc:
            ensure_port_free("127.0.0.1", port)
    msg = str(exc.value)
    assert f"port {port} on 127.0.0.1 is not free" in msg and f"pid {os.getpid()}" in msg and "--port" in msg
    assert port_is_free("127.0.0.1", port)  # released


def test_wildcard_listener_blocks_loopback_bind():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert not port_is_free("127.0.0.1", s.getsockname()[1])
