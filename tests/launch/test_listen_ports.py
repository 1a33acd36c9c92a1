"""``listen_ports``: ports for servers started later are chosen below the kernel's ephemeral range, so nothing that
binds port 0 or connects out in the meantime (vLLM's internal ports, a second server's start-up) can take them."""

from __future__ import annotations

import socket

import pytest

from trainer.launch import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high
    chosen = ports.listen_ports(8)
    assert len(set(chosen)) == 8 and all(ports.LISTEN_RANGE_START <= p < max(low, ports.LISTEN_RANGE_START + 1000)
                                         for p in chosen)
    for p in chosen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    again = ports.listen_ports(8)
    assert not set(again) & set(chosen), "a port is handed out once per process"


def test_a_port_someone_listens_on_is_never_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LISTEN_RANGE_START", taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1000, taken + 2000))
        assert taken not in ports.listen_ports(20)


def test_no_free_port_is_an_error_naming_the_range(monkeypatch):
    monkeypatch.setattr(ports, "port_is_free", lambda host, port: False)
    with pytest.raises(ports.PortInUseError, match=r"found only 0 of 2 free ports in 20000-"):
        ports.listen_ports(2)
