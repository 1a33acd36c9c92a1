"""`make test` builds the docs site with ``mkdocs build --strict``, the README stays short,
and the product never speaks of how it was made: no run numbers or workspace words in any tracked file of the
product (docs, code, configs, chart, presets, jobs, images, make files)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.docs.docs_helpers import REPO

#: what the product must never say: run numbers ("session 12", "sessions 15-25", "h200-session7"), the workspace's
#: words for GPU time and its tooling, stashes, and paths into the workspace beside the repository
PROCESS_WORDS = re.compile(
    r"\bsessions?[\s_-]*\d+|\bdevice\s+budget|\bdevice\s+seconds|gpu-bundle|\bstash|\.\./shared", re.IGNORECASE)
#: the product's tracked files (git pathspecs): README, docs, package, configs, chart, presets and values files, job
#: specs, images, make files, benchmark tables, tests and CI (this file excepted: it spells the words out);
#: CHANGELOG.md may carry dates, never run numbers
PRODUCT = ["README.md", "CHANGELOG.md", "docs", "trainer", "configs", "charts", "presets", "jobs", "images", "mk",
           "Makefile", "mkdocs.yml", "*values*.yaml", "benchmarks", "tests", ".ci", ":!tests/docs/test_docs_site.py"]
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


@pytest.mark.parametrize("line", ["measured in session 12", "Sessions 15-25 charged", "runs/h200-session7/x",
                                  "the device budget", "see ../shared/specs", "tools/gpu-bundle", "git stash pop",
                                  "device seconds"])
def test_process_words_are_caught(line, tmp_path):
    assert PROCESS_WORDS.search(line)


@pytest.mark.parametrize("line", ["a session of the server", "the TCPStore session", "sessions", "2026-11-28, H100",
                                  "device time", "shared memory", "../presets/x.yaml"])
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
