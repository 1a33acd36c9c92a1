"""Synthetic summary dataset: deterministic, both domains plus irrelevant rows, ms-swift GRPO row format,
references that score perfectly against themselves, and a schema tree that matches the generator's tables."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from trainer.grpo.rewards import REWARD_NAMES, RewardContext, reference_from_row, score
from trainer.grpo.schema_tree import schema_tree_from_jsonl
from trainer.grpo.summary_data import BBU_CATEGORIES, RRU_CATEGORIES, generate_rows, main, write_dataset
from trainer.grpo.summary_format import parse_answer


def test_deterministic_by_seed():
    assert generate_rows(30, seed=7) == generate_rows(30, seed=7)
    assert generate_rows(30, seed=7) != generate_rows(30, seed=8)


def test_domains_and_irrelevant_rows_present():
    domains = [r["domain"] for r in generate_rows(200, seed=1)]
    assert {"BBU", "RRU", None} <= set(domains)
    assert 0.05 < domains.count(None) / len(domains) < 0.3


def test_rows_are_ms_swift_grpo_rows(summary_dataset: Path):
    rows = [json.loads(line) for line in summary_dataset.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 48
    for row in rows:
        assert set(row) == {"messages", "images", "summary_ref", "metadata"}
        assert row["messages"][-1]["role"] == "user" and "<image>" in row["messages"][-1]["content"]
        assert len(row["images"]) == 1 and Path(row["images"][0]).is_absolute()
        with Image.open(row["images"][0]) as img:
            assert img.size == (64, 64)
        parsed = parse_answer(row["summary_ref"])
        if row["metadata"]["domain"] is None:
            assert parsed.is_irrelevant
        else:
            assert parsed.two_line_shape and parsed.header_domain == row["metadata"]["domain"]
            assert parsed.summary["dataset"] == row["metadata"]["domain"] and not parsed.duplicate_keys


def test_references_score_perfectly_against_themselves(summary_dataset: Path):
    ctx = RewardContext(schema_tree=schema_tree_from_jsonl([summary_dataset]))
    for line in summary_dataset.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        ref = reference_from_row(row["summary_ref"], row["metadata"])
        s = {name: score(name, row["summary_ref"], ref, ctx) for name in REWARD_NAMES}
        if not ref.relevant:
            assert s == {n: (1.0 if n == "summary.format" else 0.0) for n in REWARD_NAMES}
            continue
        bbu, rru = ref.domain == "BBU", ref.domain == "RRU"
        expected = {n: 1.0 for n in REWARD_NAMES}
        expected.update({"summary.strict": 0.0, "summary.parse": 0.0, "summary.no_dup_keys": 0.0,
                         "summary.text_bbu": float(bbu), "summary.notes_bbu": float(bbu and "备注" in ref.summary),
                         "summary.group_stats_presence": float(rru and "分组统计" in ref.summary)})
        assert s == expected, row["summary_ref"]


def test_schema_tree_matches_generator_tables(summary_dataset: Path):
    tree = schema_tree_from_jsonl([summary_dataset])
    specs = [t for t in (BBU_CATEGORIES, RRU_CATEGORIES)]
    assert set(tree.allowed) <= set(BBU_CATEGORIES) | set(RRU_CATEGORIES)
    for cat in tree.allowed:
        for_cat = [t[cat] for t in specs if cat in t]
        always = set.intersection(*(set(c.required) | ({"文本"} if c.ocr else set()) for c in for_cat))
        possible = set().union(*(set(c.required) | set(c.optional) | set(c.nested) | ({"文本"} if c.ocr else set())
                                 for c in for_cat))
        assert always <= tree.required[cat] <= tree.allowed[cat] <= possible, cat
    assert any(tree.required[c] < tree.allowed[c] for c in tree.allowed)  # optional keys exist in the corpus


def test_cli_writes_dataset(tmp_path, capsys):
    assert main([str(tmp_path / "d"), "--num-samples", "5", "--seed", "2"]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out == (tmp_path / "d" / "train.jsonl").resolve() and len(out.read_text().splitlines()) == 5
    again = write_dataset(tmp_path / "e", 5, 2)
    strip = [{k: v for k, v in json.loads(x).items() if k != "images"} for x in again.read_text().splitlines()]
    first = [{k: v for k, v in json.loads(x).items() if k != "images"} for x in out.read_text().splitlines()]
    assert strip == first
