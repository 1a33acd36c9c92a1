"""Rollout benchmarks: the functions run on CPU at smoke sizes, measure what they claim, and import without
pydantic (the GPU box that runs the full benchmark has none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.bench.rollout import rollout_batching_bench, rollout_buffer_bench, run_rollout_benches

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             intermediate_size=128, vocab_size=512)


def test_batching_bench_decodes_full_length_for_every_variant():
    res = rollout_batching_bench("cpu", n_requests=6, per_sample_requests=2, batch_sizes=(3, 6), prompt_len=(8, 20),
                                 max_new_tokens=5, variants=("dynamic", "static"), prompt_pad_multiple=8, **SMALL)
    runs = res["runs"]
    assert [(r["variant"], r["batch_size"]) for r in runs] == [
        ("dynamic", 1), ("dynamic", 3), ("dynamic", 6), ("static", 1), ("static", 3), ("static", 6)]
    assert all(r["all_full_length"] for r in runs)
    assert [r["new_tokens"] for r in runs] == [10, 30, 30] * 2, "per-sample runs on the subset, batches on all"
    assert [r["calls"] for r in runs] == [2, 2, 1] * 2
    for r in runs:
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"])
        assert r["one_time_s"] == pytest.approx(max(0.0, r["warmup_s"] - r["seconds"] / r["calls"]))
        per_sample = next(x for x in runs if x["variant"] == r["variant"] and x["batch_size"] == 1)
        assert r["speedup_vs_per_sample"] == pytest.approx(r["tokens_per_s"] / per_sample["tokens_per_s"])
    assert res["config"]["model"]["hidden_size"] == 64 and res["config"]["model"]["num_hidden_layers"] == 1


def test_buffer_bench_runs_the_trainer_and_reuses_rollouts():
    res = rollout_buffer_bench("cpu", m_steps=(1, 2), steps=2, batch_size=2, max_new_tokens=8)
    one, two = res["runs"]
    assert one["optimizer_steps"] == two["optimizer_steps"] == 2
    assert (one["rollout_calls"], two["rollout_calls"]) == (2, 1), "m_steps=2 decodes once per two optimizer steps"
    assert one["phase_s"]["forward"] > 0 and one["phase_s"]["generate"] > 0
    assert two["speedup_vs_first"] == pytest.approx(two["steps_per_s"] / one["steps_per_s"])
    with pytest.raises(ValueError, match="multiple"):
        rollout_buffer_bench("cpu", m_steps=(1, 4), steps=2)


def test_bench_module_imports_without_pydantic():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'pydantic': raise ImportError('no pydantic here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import trainer.bench.rollout, trainer.bench.weight_sync, trainer.sft.trainer, trainer.sft.stage2, trainer.modeling.fixtures\n"
        "assert 'pydantic' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_quick_run_writes_json_and_plot(tmp_path):
    res = run_rollout_benches(tmp_path, quick=True)
    saved = json.loads((tmp_path / "rollout.json").read_text())
    assert saved["quick"] is True and saved == json.loads(json.dumps(res))
    assert {r["m_steps"] for r in saved["rollout_buffer"]["runs"]} == {1, 2, 4}
    assert (tmp_path / "rollout.png").stat().st_size > 10_000
