"""Install the package's dependencies into the image's environment from a lock (locks/*.txt, `make lock`).

    python install-deps.py PYPROJECT LOCK EXTRAS [PIP_ARGS...]     (EXTRAS: "vllm,swift,deepspeed,kubernetes" or "")

Requirements come from ``[project] dependencies`` plus the named extras; pip resolves them with every pin of LOCK
as a constraint, so the image holds the locked versions (the GPU images: locks/gpu-runtime.txt; the CPU images on
the local base: locks/cpu-test.txt). The exception is the CUDA stack the base image ships (torch, vLLM and what is
built against them, BASE_STACK): it is never re-installed, and torch and vLLM in the base must be the locked
versions (the lock was resolved for that base), else the build stops. torch is never fetched from an index (a
bare ``torch`` requirement would pull a multi-GB CUDA build): it comes from the base image or a wheel.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from importlib import metadata

import tomllib

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
# Built against the base's CUDA / torch: taken from the base when it has them, never replaced from an index.
BASE_STACK = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|vllm|xformers|flashinfer-.*|nvidia-.*"
                        r"|cuda-.*|cupy-.*)$")
MUST_MATCH = ("torch", "vllm")  # the base must ship the locked versions of these


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    match = NAME.match(line.split("#", 1)[0])
    return canonical(match.group(1)) if match else None


def lock_pins(lock_lines: list[str]) -> dict[str, str]:
    """{name: 'name==version'} of a lock's pin lines (comments and `# via` lines dropped)."""
    pins = {}
    for line in lock_lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            pins[requirement_name(line)] = line
    return pins


def release(version: str) -> str:
    return version.split("+", 1)[0]


def plan(requirements: list[str], lock_lines: list[str], installed: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(requirements without torch, the constraints to apply, problems). Every lock pin applies except those of
    the base's CUDA stack (BASE_STACK) that the base already ships; torch and vLLM there must match the lock."""
    reqs = [r for r in requirements if requirement_name(r) != "torch"]
    pins, problems = [], []
    for name, pin in lock_pins(lock_lines).items():
        if name in installed and BASE_STACK.match(name):
            locked = pin.split("==", 1)[1].split(";", 1)[0].strip()
            if name in MUST_MATCH and release(installed[name]) != release(locked):
                problems.append(f"the base image has {name} {installed[name]}, the lock says {locked}: build on the "
                                f"base the lock was made for (or `make lock` for this base)")
            continue
        pins.append(pin)
    return reqs, pins, problems


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    pyproject, lock, pip_args = argv[0], argv[1], argv[3:]
    extras = [e.strip() for e in argv[2].split(",") if e.strip()]
    project = tomllib.load(open(pyproject, "rb"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        print(f"unknown extras {unknown}; pyproject defines {sorted(optional)}", file=sys.stderr)
        return 2
    requirements = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    if "torch" not in installed:
        print("torch is not installed: build on a base image with torch, or put the CPU wheel in the build "
              "context (make images copies it to build/docker-context/wheels/)", file=sys.stderr)
        return 2
    with open(lock) as f:
        requirements, pins, problems = plan(requirements, f.readlines(), installed)
    if problems:
        print(*problems, sep="\n", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c, \
            tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as r:
        c.write("\n".join(pins) + "\n")
        r.write("\n".join(requirements) + "\n")
    print(f"installing {len(requirements)} requirements (extras: {extras or 'none'}) from {lock}: "
          f"{len(pins)} pins apply, {len(installed)} packages come from the base")
    return subprocess.call([sys.executable, "-m", "pip", "install", "--no-cache-dir", *pip_args, "-c", c.name, "-r", r.name])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
