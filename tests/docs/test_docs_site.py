"""`make test` builds the docs site with ``mkdocs build --strict``, the README stays short,
and the product never speaks of how it was made: no run numbers or workspace words in any tracked file of the
product (docs, code, configs, chart, presets, jobs, images, make files)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.docs.docs_helpers import REPO

#: what names the workspace instead of the product: numbered runs, the words for lent GPU time and its tooling, and
#: paths out of the repository. Each term is spelled in pieces, so that this file never says what it forbids.
_RUN, _TOOL, _AWAY, _TICKET = "s" + "ession", "gpu-" + "bundle", "../" + "shared", "iss" + "ue"
_TERMS = (rf"\b{_RUN}s?[\s_-]*\d+", r"\bdevice\s+bud" + "get", r"\bdevice\s+sec" + "onds", re.escape(_TOOL),
          r"\bst" + "ash", re.escape(_AWAY), rf"\b{_TICKET}\s+#?\d+", r"\bvLLM\s+bun" + "dle")
PROCESS_WORDS = re.compile("|".join(_TERMS), re.IGNORECASE)
#: the product's tracked files (git pathspecs): README, docs, package, configs, chart, presets and values files, job
#: specs, images, make files, benchmark tables, tests and CI; CHANGELOG.md may carry dates, never run numbers
PRODUCT = ["README.md", "CHANGELOG.md", "docs", "trainer", "configs", "charts", "presets", "jobs", "images", "mk",
           "Makefile", "mkdocs.yml", "*values*.yaml", "benchmarks", "tests", ".ci"]
BINARY = (".png", ".jpg", ".jpeg", ".gif", ".gz", ".whl", ".pt", ".safetensors", ".bin", ".ico")


def tracked(pathspecs: list[str]) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *pathspecs], cwd=REPO, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and not p.endswith(BINARY) and (REPO / p).is_file()]


def process_words(path: str) -> list[str]:
    hits = []
    text = (REPO / path).read_text(errors="replace")
    for n, line in enumerate(text.splitlines(), 1):
        for m in PROCESS_WORDS.finditer(line):
            hits.append(f"{path}:{n}: {m.group(0)!r} in: {line.strip()[:160]}")
    return hits


def test_the_product_never_says_session_numbers_or_workspace_words():
    files = tracked(PRODUCT)
    assert any(f.startswith("trainer/") for f in files) and "README.md" in files
    hits = [h for f in files for h in process_words(f)]
    assert not hits, "say what was measured (date, GPU, command), not which run measured it:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [f"measured in {_RUN} 12", f"{_RUN.title()}s 15-25 charged", f"runs/h200-{_RUN}7/x",
                                  "the device " + "budget", f"see {_AWAY}/specs", f"tools/{_TOOL}", "git st" + "ash pop",
                                  "device " + "seconds", f"({_TICKET} 37, the 8B sync)", f"{_TICKET.title()} 36 on GPUs",
                                  "with the vLLM " + "bundle"])
def test_process_words_are_caught(line, tmp_path):
    assert PROCESS_WORDS.search(line)


@pytest.mark.parametrize("line", ["a session of the server", "the TCPStore session", "sessions", "2026-11-28, H100",
                                  "device time", "shared memory", "../presets/x.yaml", "the CA bundle",
                                  "the kernel it issues", "issues 2 copies"])
def test_ordinary_words_pass(line):
    assert not PROCESS_WORDS.search(line)


def test_readme_is_short_and_readable():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    long = [n for n, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text


def test_make_test_builds_the_site():
    """`make test` runs `make docs`, which builds the site with `mkdocs build --strict` (a warning, a broken link or
    anchor, a page missing from the nav fails); tests/docs/test_docs_reference.py checks what the generated pages
    hold."""
    makefile = (REPO / "Makefile").read_text()
    docs_recipe = re.search(r"^docs: .*\n((?:\t.*\n)+)", makefile, re.M)
    assert docs_recipe and "mkdocs build --strict" in docs_recipe.group(1)
    test_recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "docs" in test_recipe, "make test runs the docs target"
