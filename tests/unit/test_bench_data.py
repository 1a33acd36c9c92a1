"""``bench --only data`` on a few hundred records: every variant measured in its own subprocess, JSON + PNG written."""

from __future__ import annotations

import json

from trainer.bench.data import VARIANTS, generate, run


def test_generated_records_are_valid_and_realistic(tmp_path):
    from trainer.data.check import check_lines

    path = generate(tmp_path, 300)
    report = check_lines(path, path.parent)
    assert report.ok and report.records == 300 and report.counts == {}
    objects = sum(len(json.loads(line)["objects"]) for line in path.read_text().splitlines())
    assert 17 <= objects / 300 <= 23


def test_quick_data_bench_writes_every_variant(tmp_path):
    result = run(tmp_path, records=300)
    saved = json.loads((tmp_path / "data.json").read_text())
    assert saved == result and (tmp_path / "data.png").stat().st_size > 0
    assert [r["variant"] for r in result["results"]] == [v for v, _, _ in VARIANTS]
    for r in result["results"]:
        assert "error" not in r, r
        assert r["records"] == 300 and r["startup_s"] > 0 and r["peak_rss_mb"] >= r["baseline_rss_mb"] > 0


def test_cli_parses_the_data_bench():
    from trainer.cli import build_parser

    args = build_parser("bench").parse_args(["bench", "--only", "data", "--quick"])
    assert args.only == "data" and args.quick
