"""The benchmark package: one random-model builder, the command line, and the stage-2 packing benchmark running the
trainer's forward_loss on stage-2-shaped targets (CPU smoke run)."""

from __future__ import annotations

import random

import pytest

from trainer.bench.models import TINY, random_qwen3
from trainer.bench.packing import model_flops, run_bench, stage2_segment
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
    assert {"padded/supervised ×2", "packed-mask/supervised ×2", "padded/full ×4", "packed-mask/supervised ×4",
            "packed-mask/supervised+chunked ×4"} <= set(names)
    assert {"padded/full ×2 compiled", "packed-mask/supervised ×4 compiled"} <= set(names)
    assert all(r["real_tokens_per_s"] > 0 for r in result["results"])
    assert result["padded_tokens_per_pass"]["4"] >= result["real_tokens_per_pass"]
    assert 0 < result["supervised_positions_fraction"] < 1


def test_packing_without_a_gpu_refuses_with_advice(capsys, tmp_path):
    import torch

    from trainer.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the full bench would run instead of refusing")
    assert main(["bench", "packing", "--out", str(tmp_path)]) == 2
    assert "--quick" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_random_qwen3_builds_the_requested_shape_in_the_requested_mode():
    import torch

    model = random_qwen3(dict(TINY, num_hidden_layers=1), dtype=torch.bfloat16, seed=3)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (TINY["hidden_size"], 1, TINY["vocab_size"])
    assert cfg.intermediate_size == TINY["intermediate_size"] and cfg.tie_word_embeddings
    assert not model.training and model.generation_config.eos_token_id is None
    assert next(model.parameters()).dtype == torch.bfloat16
    again = random_qwen3(dict(TINY, num_hidden_layers=1), dtype=torch.bfloat16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters())), "seeded"
    trained = random_qwen3(dict(TINY, num_hidden_layers=1), train=True, gradient_checkpointing=True, eos_token_id=1)
    checkpointing = getattr(trained, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers before 5.2x
        checkpointing = trained.is_gradient_checkpointing
    assert trained.training and checkpointing and trained.config.eos_token_id == 1


def test_cli_bench_parses_every_subcommand_and_defaults_to_the_cpu_table():
    from trainer.bench import CPU_TABLE
    from trainer.cli import COMMAND_MODULES, build_parser

    assert COMMAND_MODULES["bench"] == "trainer.bench"
    parser = build_parser("bench")
    run = parser.parse_args(["bench", "run", "benchmarks/layouts.yaml", "--only", "colocate-1,colocate-2"])
    assert run.table == "benchmarks/layouts.yaml" and run.only == "colocate-1,colocate-2" and callable(run.action)
    images = parser.parse_args(["bench", "vllm-images", "--requests", "64", "--pixel-threads", "default,1",
                                "--no-plain"])
    assert (images.requests, images.pixel_threads, images.no_plain) == ("64", "default,1", True)
    assert parser.parse_args(["bench", "packing", "--quick"]).quick
    assert parser.parse_args(["bench", "plot"]).records == "docs/benchmarks"
    bare = parser.parse_args(["bench"])
    assert bare.action is None and callable(bare.func) and CPU_TABLE.is_file()
