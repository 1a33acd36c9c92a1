"""Post-install check (the chart's ``helm test`` pod): the mounted training YAML validates, and every rollout
server answers ``GET /health/`` and reports the expected ``/get_world_size/``.

``python -m trainer.deploy.smoke --config PATH [--servers URL,URL --expect-world-size N]``; exit 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from trainer.config.errors import ConfigErrors


def check_server(url: str, expect_world_size: int | None, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """Problems found on one server (``[]`` when healthy)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s, headers=headers) as client:
            health = client.get(f"{base}/health/")
            if health.status_code != 200:
                return [f"{base}/health/ answered {health.status_code}"]
            world = client.get(f"{base}/get_world_size/")
    except httpx.HTTPError as exc:
        return [f"{base}: unreachable ({type(exc).__name__}: {exc})"]
    if world.status_code != 200:
        return [f"{base}/get_world_size/ answered {world.status_code}"]
    size = world.json().get("world_size")
    if expect_world_size is not None and size != expect_world_size:
        return [f"{base}/get_world_size/ reports {size}, expected {expect_world_size} (tensor × data parallel)"]
    return []


def check_config(path: str) -> list[str]:
    from trainer.config.schema import load_config

    try:
        load_config(path)
    except ConfigErrors as exc:
        return [str(exc)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.deploy.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="training YAML to validate")
    parser.add_argument("--servers", default="", help="comma-separated server base URLs")
    parser.add_argument("--expect-world-size", type=int)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--api-key-env", help="environment variable holding the servers' bearer token")
    args = parser.parse_args(argv)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    problems = check_config(args.config) if args.config else []
    for url in filter(None, args.servers.split(",")):
        found = check_server(url, args.expect_world_size, args.timeout_s, api_key)
        print(f"{'FAIL' if found else 'ok  '} {url}")
        problems += found
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    print("deployment check " + ("failed" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
