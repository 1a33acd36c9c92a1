"""``bench --only lora-merge`` (quick): both merge precisions and the copy floor timed side by side in one run, the
two merges compared element by element, JSON and plot written; the element comparison itself is checked on
tensors with known differences."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.bench.lora_merge import compare, run


def test_quick_run_times_both_precisions_beside_the_copy_floor(tmp_path):
    result = run(tmp_path, quick=True)
    saved = json.loads((tmp_path / "lora_merge_quick.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved["median_ms"]) == {"weight_dtype", "float32", "floor"}
    assert all(len(s) == saved["repeats"] and min(s) > 0 for s in saved["seconds"].values())
    assert saved["adapted_layers"] == 7 * 2  # q, k, v, o, gate, up, down in each of the two layers
    assert saved["float32_over_weight_dtype"] == pytest.approx(
        saved["median_ms"]["float32"] / saved["median_ms"]["weight_dtype"])
    agreement = saved["agreement"]
    assert 0 < agreement["fraction_differing"] < 0.1  # the precisions differ, in few elements
    assert agreement["fraction_beyond_one_step"] < 0.2 * agreement["fraction_differing"]  # cancellations only
    assert 0 < agreement["max_difference_rms_steps"] <= 4  # absolute differences: a rounding step of typical weights
    assert (tmp_path / "lora_merge_quick.png").stat().st_size > 5_000


def test_compare_counts_differing_elements_in_rounding_steps():
    y = torch.tensor([1.0, 1.0, 0.5, -3.0], dtype=torch.bfloat16)
    x = y.clone()
    x[1] = 1 + 2**-7  # one bf16 step at 1
    x[3] = -3.0 - 2 * 2**-6  # two steps of 2**-6 at |3|
    out = compare({"w": x}, {"w": y}, ["w"])
    assert out["fraction_differing"] == 0.5 and out["fraction_beyond_one_step"] == 0.25
    rms_step = 2.0**-7  # rms of y is ~1.7: steps of 2**-7
    assert out["max_difference_rms_steps"] == pytest.approx(2 * 2**-6 / rms_step)
