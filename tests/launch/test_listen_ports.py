"""``listen_ports``: ports for servers started later are chosen below the kernel's ephemeral range, so nothing that
binds port 0 or connects out in the meantime (vLLM's internal ports, a second server's start-up) can take them."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest

from tests.launch.conftest import REPO
from trainer.launch import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high
    start, stop = ports.listen_range()
    assert stop == low and start in (ports.LISTEN_RANGE_START, ports.UNPRIVILEGED_START)
    chosen = ports.listen_ports(8)
    assert len(set(chosen)) == 8 and all(start <= p < low for p in chosen)
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
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    with pytest.raises(ports.PortInUseError, match=r"found only 0 of 2 free ports in 20000-32767 on 127\.0\.0\.1"):
        ports.listen_ports(2)


def test_processes_seeded_alike_draw_different_ports():
    """``set_seed`` seeds ``random`` equally in every rank: the draw must not come from it."""
    code = "import random; random.seed(0); from trainer.launch.ports import listen_ports; print(listen_ports(4))"
    drawn = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            timeout=120).stdout for _ in range(2)]  # 120 s bounds a hang only
    assert drawn[0] != drawn[1], drawn
    random.seed(0)
    state = random.getstate()
    ports.listen_ports(2)
    assert random.getstate() == state, "listen_ports must leave the global random state alone"


def test_ports_stay_below_an_ephemeral_range_that_starts_low(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (15000, 60999))
    assert ports.listen_range() == (ports.UNPRIVILEGED_START, 15000)
    assert all(ports.UNPRIVILEGED_START <= p < 15000 for p in ports.listen_ports(8))


def test_an_ephemeral_range_leaving_no_room_below_is_an_error(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with pytest.raises(ports.PortInUseError, match=r"no port below the kernel's ephemeral range 1024-65535 "
                                                   r"\(/proc/sys/net/ipv4/ip_local_port_range\).*ip_local_port_range="):
        ports.listen_ports(1)


def test_the_ephemeral_range_is_read_from_the_kernel_else_the_linux_default(monkeypatch, tmp_path):
    conf = tmp_path / "ip_local_port_range"
    conf.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(conf))
    assert ports.ephemeral_range() == (40000, 50000)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "absent"))
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL == (32768, 60999)
