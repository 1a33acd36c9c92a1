"""docs/reference/metrics.md lists every key the trainer logs: the keys of a real short stage-2 run (tiny text model,
HF rollouts, packing, a held-out split, a stage-1 warm-up) and every metric-key literal in the package's source. A
`<name>` in a documented key stands for any name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.docs.docs_helpers import REPO

DOC = REPO / "docs" / "reference" / "metrics.md"
NAMESPACES = ("loss", "rollout", "time", "mem", "batch", "buffer", "sync", "train", "gc", "compile", "eval", "packing",
              "tokens", "speed", "mismatch")
METRIC_KEY = re.compile(rf"^(?:{'|'.join(NAMESPACES)})/[\w@.]+$")
ROW_KEYS = ("phase", "step", "time")  # every row's own fields, described in the page's opening


def documented_keys() -> list[str]:
    """The keys named in the first column of the page's tables."""
    out = []
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            out += re.findall(r"`([^`]+)`", line.split("|")[1])
    return out


def template(key: str) -> re.Pattern[str]:
    """``key`` as a pattern: each `<name>` in it stands for any name."""
    return re.compile("^" + "".join(r"[\w@.]+" if part.startswith("<") else re.escape(part)
                                    for part in re.split(r"(<[^>]+>)", key) if part) + "$")


def documented() -> list[re.Pattern[str]]:
    return [template(k) for k in documented_keys()]


def undocumented(keys: set[str]) -> list[str]:
    patterns = documented()
    return sorted(k for k in keys if k not in ROW_KEYS and not any(p.match(k) for p in patterns))


def test_documented_patterns_match_what_they_should():
    patterns = documented()
    assert any(p.match("time/sync_wake_s") for p in patterns), "time/<phase>_s covers every phase"
    assert any(p.match("mem/forward_peak_gib") for p in patterns)
    assert not any(p.match("loss/made_up_term") for p in patterns)


def source_keys() -> tuple[set[str], set[str]]:
    """Metric-key string literals in trainer/ (benchmarks excluded), and the f-string keys with a constant namespace
    (each `{…}` written `<name>`)."""
    keys, templates = set(), set()
    for path in (REPO / "trainer").rglob("*.py"):
        if "bench" in path.relative_to(REPO / "trainer").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC_KEY.match(node.value):
                keys.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
                if re.match(rf"^(?:{'|'.join(NAMESPACES)})/[\w@.<>]+$", text):
                    templates.add(text)
    return keys, templates


def test_every_metric_key_in_the_source_is_documented():
    keys, templates = source_keys()
    assert {"loss/ce", "rollout/valid_object_rate", "train/checkpointing_policy"} <= keys, "the scan finds keys"
    assert "time/<x>_s" in templates
    missing = undocumented(keys)
    assert not missing, f"logged but not in docs/reference/metrics.md: {missing}"
    listed = documented_keys()
    bare = [t for t in templates if not any(template(t).match(re.sub(r"<[^>]+>", "name", k)) for k in listed)]
    assert not bare, f"keys made from a name, none of them in docs/reference/metrics.md: {bare}"


@pytest.mark.slow
def test_every_key_a_short_run_logs_is_documented(tmp_path):
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training
    from trainer.telemetry import read_jsonl

    cfg = validate_config({
        "model": {"tiny": "text"},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64,
                               "eval_num_samples": 2}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "eval_steps": 1, "learning_rate": 2e-3, "seed": 0, "disable_tqdm": True, "report_to": ["jsonl"],
                     "packing": True, "packing_length": 512},
        "stage1": {"steps": 1, "batch_size": 2, "logging_steps": 1},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 4,
            "decoding": {"max_new_tokens": 24}, "matching": {"mask_resolution": 64}}}},
    })
    summary = run_training(cfg)
    rows = read_jsonl(Path(summary.metrics_path))
    keys = {k for r in rows for k in r}
    assert {r["phase"] for r in rows} >= {"setup", "stage2", "eval"}
    assert {"loss/ce", "time/rollout_s", "packing/segments_per_row", "eval/f1@50"} <= keys
    missing = undocumented(keys)
    assert not missing, f"logged but not in docs/reference/metrics.md: {missing}"
