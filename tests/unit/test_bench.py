"""The stage-2 packing benchmark runs the trainer's forward_loss on stage-2-shaped targets (CPU smoke run)."""

from __future__ import annotations

import random

import pytest

from trainer.bench import TINY, model_flops, run_bench, stage2_segment
from trainer.matching.targets import IGNORE_INDEX


def test_stage2_segment_has_prompt_prefix_coords_and_tail_labels():
    coord = list(range(4000, 4096))
    t = stage2_segment(random.Random(0), "s", 400, 4096, coord)
    assert t.length == 400 and 120 <= t.prompt_len <= 240
    labelled = [i for i, lab in enumerate(t.labels) if lab != IGNORE_INDEX]
    assert labelled and min(labelled) >= t.prompt_len + t.prefix_len, "CE only in the tail"
    assert t.coord_positions and min(t.coord_positions) >= t.prompt_len
    assert all(t.input_ids[p] in coord for p in t.coord_positions)
    assert not set(t.coord_positions) & set(labelled)


def test_model_flops_grow_with_tokens_and_quadratically_with_attention():
    assert model_flops(TINY, [100, 100]) == 2 * model_flops(TINY, [100])
    assert model_flops(TINY, [200]) > 2 * model_flops(TINY, [100])


def test_quick_bench_reports_every_cpu_variant():
    result = run_bench(TINY, micro_batch=2, segments=4, wide=4, min_len=16, max_len=48, repeats=1, compile_layers=True)
    names = [r["variant"] for r in result["results"]]
    assert names[0] == "padded/full ×2"
    assert {"padded/supervised ×2", "packed-mask/supervised ×2", "padded/full ×4", "packed-mask/supervised ×4"} <= set(names)
    assert {"padded/full ×2 compiled", "packed-mask/supervised ×4 compiled"} <= set(names)
    assert all(r["real_tokens_per_s"] > 0 for r in result["results"])
    assert result["padded_tokens_per_pass"]["4"] >= result["real_tokens_per_pass"]
    assert 0 < result["supervised_positions_fraction"] < 1


def test_full_bench_without_a_gpu_refuses_with_advice(capsys, tmp_path):
    import argparse

    import torch

    from trainer.bench import run

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the full bench would run instead of refusing")
    args = argparse.Namespace(quick=False, out=str(tmp_path), only="all")
    assert run(args) == 2
    assert "--quick" in capsys.readouterr().out and not any(tmp_path.iterdir())
