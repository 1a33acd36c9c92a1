"""Install the package's dependencies into the image's environment without touching what the base ships.

    python install-deps.py PYPROJECT CONSTRAINTS EXTRAS [PIP_ARGS...]     (EXTRAS: "deepspeed,swift" or "")

Requirements come from ``[project] dependencies`` plus the named extras. Pins from CONSTRAINTS apply only to
packages the base image does not already have, so an official vLLM or PyTorch image keeps its own (CUDA) stack;
pip upgrades a base package only when it violates one of our ranges. torch is never fetched from an index (a
bare ``torch`` requirement would pull a multi-GB CUDA build): it must come from the base image or a wheel.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from importlib import metadata

import tomllib

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    match = NAME.match(line.split("#", 1)[0])
    return canonical(match.group(1)) if match else None


def plan(requirements: list[str], constraint_lines: list[str], installed: set[str]) -> tuple[list[str], list[str]]:
    """(requirements without torch, the pins that apply: those for packages the environment does not have)."""
    reqs = [r for r in requirements if requirement_name(r) != "torch"]
    pins = [line.strip() for line in constraint_lines
            if requirement_name(line) and requirement_name(line) not in installed]
    return reqs, pins


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    pyproject, constraints, pip_args = argv[0], argv[1], argv[3:]
    extras = [e.strip() for e in argv[2].split(",") if e.strip()]
    project = tomllib.load(open(pyproject, "rb"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        print(f"unknown extras {unknown}; pyproject defines {sorted(optional)}", file=sys.stderr)
        return 2
    requirements = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    installed = {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    if "torch" not in installed:
        print("torch is not installed: build on a base image with torch, or put the CPU wheel in the build "
              "context (make images copies it to build/docker-context/wheels/)", file=sys.stderr)
        return 2
    with open(constraints) as f:
        requirements, pins = plan(requirements, f.readlines(), installed)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c, \
            tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as r:
        c.write("\n".join(pins) + "\n")
        r.write("\n".join(requirements) + "\n")
    print(f"installing {len(requirements)} requirements (extras: {extras or 'none'}); "
          f"{len(pins)} pins apply, {len(installed)} packages come from the base")
    return subprocess.call([sys.executable, "-m", "pip", "install", "--no-cache-dir", *pip_args, "-c", c.name, "-r", r.name])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
