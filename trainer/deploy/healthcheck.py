"""Container health check for the rollout-server image: ``GET /health/`` on the server this container runs.

Host and port: ``ROLLOUT_SERVER_HOST`` / ``ROLLOUT_SERVER_PORT`` when set, else the ``--host`` / ``--port`` of the
container's main command (``/proc/1/cmdline``), else 127.0.0.1:8000. Exit 0 when healthy, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = "8000"


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def target(cmdline: list[str], env: dict[str, str]) -> str:
    host = env.get("ROLLOUT_SERVER_HOST") or _flag(cmdline, "--host") or DEFAULT_HOST
    port = env.get("ROLLOUT_SERVER_PORT") or _flag(cmdline, "--port") or DEFAULT_PORT
    if host in ("0.0.0.0", "::"):
        host = DEFAULT_HOST
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/health/"


def main() -> int:
    try:
        cmdline = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        cmdline = []
    url = target(cmdline, dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
