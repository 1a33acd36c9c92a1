"""Port checks before a server starts: is ``host:port`` free, and if not, who holds it."""

from __future__ import annotations

import errno
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
