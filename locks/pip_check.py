"""`pip check` for the environment `make setup` builds, read against the lock (run by `make test`).

    python locks/pip_check.py [LOCK] [OVERRIDES]      (defaults: locks/cpu-test.txt, locks/overrides.txt)

Runs `python -m pip check` in this interpreter and prints what it says. It passes only when
  * every problem pip reports is a requirement that OVERRIDES removes (its `# removes: <pkg> -> <req>` comments)
    or a line it accepts verbatim (`# accepts: <pip check line>`, for upstream metadata errors that are not
    requirements), and every such entry is still needed (pip check still reports it);
  * every package LOCK names is installed at the locked version, and nothing else is installed besides pip and
    this project.
So a new conflict, a stale override, or a venv that drifted from the lock fails `make test`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "rollout-matching"
UNLOCKED = {"pip", PROJECT}  # pip: pinned by the Makefile (PIP_VERSION), not the lock; the project: editable
MISSING = re.compile(r"^(\S+) (\S+) requires (\S+), which is not installed\.$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines of a uv/pip-tools lock."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[canonical(name.split("[", 1)[0])] = version.split(";", 1)[0].strip()
    return pins


def read_removals(path: Path) -> set[tuple[str, str]]:
    """{(requirer, removed requirement)} from the `# removes: a -> b` comments of the overrides file."""
    removals = set()
    for line in path.read_text().splitlines():
        match = re.search(r"#\s*removes:\s*(\S+)\s*->\s*(\S+)", line)
        if match and not line.lstrip().startswith("#"):
            removals.add((canonical(match.group(1)), canonical(match.group(2))))
    return removals


def read_accepted(path: Path) -> set[str]:
    """The `# accepts: <pip check line>` lines of the overrides file."""
    return {m.group(1).strip() for line in path.read_text().splitlines()
            if (m := re.match(r"^#\s*accepts:\s*(.+)$", line.strip()))}


def pip_check_problems(python: str = sys.executable) -> tuple[str, list[str]]:
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "No broken requirements found."]
    return text, lines


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def evaluate(problems: list[str], removals: set[tuple[str, str]], accepted: set[str], lock: dict[str, str],
             have: dict[str, str]) -> list[str]:
    """The failures (empty: the environment is the lock, and pip check reports only what the overrides document)."""
    failures = []
    reported = set()
    for line in problems:
        match = MISSING.match(line)
        pair = (canonical(match.group(1)), canonical(match.group(3))) if match else None
        if pair in removals:
            reported.add(pair)
        elif line not in accepted:
            failures.append(f"pip check: {line}")
    for line in sorted(accepted - set(problems)):
        failures.append(f"pip check no longer reports '{line}': drop that `accepts` entry")
    for requirer, removed in sorted(removals - reported):
        if removed in have:
            failures.append(f"{removed} is installed although locks/overrides.txt removes it ({requirer} -> {removed})")
        elif requirer in have:
            failures.append(f"pip check no longer reports {requirer} -> {removed}: drop that override")
    for name, version in sorted(lock.items()):
        if name not in have:
            failures.append(f"{name}=={version} is locked but not installed")
        elif have[name] != version:
            failures.append(f"{name} {have[name]} is installed, the lock says {version}")
    extra = sorted(set(have) - set(lock) - UNLOCKED)
    if extra:
        failures.append(f"installed but not in the lock: {', '.join(extra)} (rebuild the venv: rm -rf .venv; make setup)")
    return failures


def main(argv: list[str]) -> int:
    lock_path = Path(argv[0]) if argv else ROOT / "locks" / "cpu-test.txt"
    overrides_path = Path(argv[1]) if len(argv) > 1 else ROOT / "locks" / "overrides.txt"
    text, problems = pip_check_problems()
    print(f"$ pip check\n{text}")
    failures = evaluate(problems, read_removals(overrides_path), read_accepted(overrides_path),
                        read_lock(lock_path), installed())
    if failures:
        print(f"FAILED ({lock_path.name}, {overrides_path.name}):", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"ok: the environment is {lock_path.name} ({len(read_lock(lock_path))} packages); pip check reports "
          f"only the {len(problems)} problems {overrides_path.name} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
