"""Port checks before a server starts: is ``host:port`` free, and if not, who holds it."""

from __future__ import annotations

import errno
import random
import socket


class PortInUseError(RuntimeError):
    pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_is_free(host: str, port: int) -> bool:
    """True when a listener could bind ``host:port`` now (``SO_REUSEADDR`` like uvicorn/vLLM, so TIME_WAIT is free)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_holder(port: int) -> str | None:
    """``"pid N (cmdline)"`` of the process listening on ``port``, when the OS lets us see it."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline()) or psutil.Process(c.pid).name()
            except psutil.Error:
                cmd = "?"
            return f"pid {c.pid} ({cmd[:200]})"
    return None


def ensure_port_free(host: str, port: int) -> None:
    """Raise ``PortInUseError`` naming the port (and its holder, when knowable) unless ``host:port`` is free."""
    if port_is_free(host, port):
        return
    holder = port_holder(port)
    who = f"held by {holder}" if holder else "held by another process"
    raise PortInUseError(f"port {port} on {host} is not free ({who}); stop that process or choose another --port "
                         f"(and the matching rlhf.vllm_server_port / server base_url in the learner config)")


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: the kernel's ephemeral range where ``EPHEMERAL_RANGE_FILE`` cannot be read (Linux's default)
DEFAULT_EPHEMERAL = (32768, 60999)
#: ``listen_ports`` draws from here up to the ephemeral range (from ``UNPRIVILEGED_START`` when that range starts lower)
LISTEN_RANGE_START = 20000
UNPRIVILEGED_START = 1024
_HANDED_OUT: set[int] = set()  # ports this process already chose: never chosen twice, bound or not yet
#: candidates come from the OS's entropy, not the ``random`` module that ``set_seed`` makes equal in every process
_RNG = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound as port 0 and for outgoing connections (``EPHEMERAL_RANGE_FILE``;
    ``DEFAULT_EPHEMERAL`` where it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def listen_range() -> tuple[int, int]:
    """``[start, stop)`` that ``listen_ports`` draws from: ``LISTEN_RANGE_START`` (``UNPRIVILEGED_START`` where the
    ephemeral range starts at or below it) up to the ephemeral range's first port. Raises ``PortInUseError`` when
    the ephemeral range leaves no unprivileged port below it."""
    low, high = ephemeral_range()
    start = LISTEN_RANGE_START if low > LISTEN_RANGE_START else UNPRIVILEGED_START
    if low <= start:
        raise PortInUseError(f"no port below the kernel's ephemeral range {low}-{high} ({EPHEMERAL_RANGE_FILE}) to "
                             f"hand to a server that starts later (a port from that range can be taken by any process "
                             f"binding port 0 first); narrow the range, e.g. sysctl -w "
                             f"net.ipv4.ip_local_port_range='{DEFAULT_EPHEMERAL[0]} {DEFAULT_EPHEMERAL[1]}', or give "
                             "the ports explicitly")
    return start, low


def listen_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free on ``host`` now and lie below the ephemeral range (``listen_range``), for
    servers started later on this host. A port from the ephemeral range (what binding port 0 returns) can be handed
    to another process that binds port 0 or connects out (vLLM's internal ports, a second server's start-up) before
    the server given it binds; a port below that range is only ever taken by name. A port is handed out once per
    process; candidates are drawn from OS entropy, so processes seeded alike still draw different ports."""
    start, stop = listen_range()
    candidates = _RNG.sample(range(start, stop), min(stop - start, 50 * n + 200))
    out: list[int] = []
    for port in candidates:
        if port not in _HANDED_OUT and port_is_free(host, port):
            out.append(port)
            if len(out) == n:
                _HANDED_OUT.update(out)
                return out
    raise PortInUseError(f"found only {len(out)} of {n} free ports in {start}-{stop - 1} on {host} (below the "
                         f"kernel's ephemeral range); stop servers this host no longer needs, or give the ports "
                         "explicitly")


def listen_port(host: str = "127.0.0.1") -> int:
    """One port as ``listen_ports`` chooses them."""
    return listen_ports(1, host)[0]
