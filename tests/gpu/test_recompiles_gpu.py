"""Zero recompiles after the first step, on GPUs (deselected on CPU): ``python -m pytest -m gpu
tests/gpu/test_recompiles_gpu.py`` on a 2-GPU machine with vLLM installed.

A 2-rank colocate learner (torchrun, vLLM colocate on each rank, the tiny Qwen3-VL, compiled decoder layers with
Inductor, packed rows with the varlen op) trains 8 steps: its metrics log ``compile/recompiles_after_first_step`` 0 at
every step (summed over both ranks) and ``compile/new_graphs`` 0 after the first. And the CPU test's 50 pack layouts
(``tests/unit/test_compile_recompiles.py``) through the layers compiled by Inductor on one GPU, the CUDA flash kernels
of the op included: one graph, none compiled after the first layout."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs: run on a GPU device machine")]

STEPS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trainer.bench.runner import save_model

    return save_model("tiny", tmp_path_factory.mktemp("model"), cuda=True)


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_two_colocate_ranks_compile_nothing_after_the_first_step(model_dir, tmp_path, tuner):
    """The learners of ``tests/gpu/test_multigpu_gpu.py`` (its table's base: 16 records a step, vLLM colocate at 0.2
    of each GPU, sleep level 2), with compiled layers and 1024-token rows, for 8 steps."""
    from tests.gpu.test_multigpu_gpu import _need, _ok, _run
    from trainer.telemetry import read_jsonl

    _need(2)
    name = f"colocate-2-compiled-{tuner}"
    config = {"training": {"max_steps": STEPS, "compile_decoder_layers": True, "packing_length": 1024},
              "data": {"synthetic": {"num_samples": 16 * STEPS}}}
    if tuner != "full":
        config["tuner"] = {"train_type": tuner, "lora_rank": 16, "lora_alpha": 32}
    _ok(_run(name, model_dir, tmp_path, 2, **config))
    rows = [r for r in read_jsonl(tmp_path / "runs" / name / "metrics.jsonl")
            if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == STEPS
    assert rows[0]["compile/new_graphs"] > 0, "the layers ran compiled"
    recompiles = [r["compile/recompiles_after_first_step"] for r in rows]
    new_graphs = [r["compile/new_graphs"] for r in rows]
    layouts = [r.get("packing/segments_per_row") for r in rows]
    print(f"GPU_RECOMPILES_RESULT {tuner}: recompiles_after_first_step {recompiles}, new_graphs {new_graphs}, "
          f"segments per row {layouts}")
    assert recompiles == [0.0] * STEPS, (recompiles, new_graphs, layouts)
    assert new_graphs[1:] == [0.0] * (STEPS - 1), (new_graphs, layouts)


def test_fifty_pack_layouts_compile_the_inductor_layers_once_on_a_gpu():
    from torch._dynamo.utils import counters

    import tests.unit.test_compile_recompiles as layouts
    from trainer.modeling.compile import compile_decoder_layers
    from trainer.modeling.fixtures import build_tiny_model
    from trainer.packing.packed_batch import pack_targets
    from trainer.packing.varlen_attention import packed_attention, register_varlen_attention, unguarded_segment_counts
    from trainer.sft.forward import LOSS_KEYS

    torch._dynamo.reset()
    counters.clear()
    model, _ = build_tiny_model("vl", seed=0)
    model = model.to("cuda", torch.bfloat16).train()
    impl = register_varlen_attention("op")
    compile_decoder_layers(model)
    rng = random.Random(0)
    graphs = []
    for i, layout in enumerate(layouts._layouts(rng)):
        targets = [layouts._target(rng, model.config, n, images, f"r{i}s{j}") for j, (n, images) in enumerate(layout)]
        batch = pack_targets(targets, impl, model, model.config.image_token_id)
        inputs = {k: (v.to("cuda", torch.bfloat16) if torch.is_floating_point(v) else v.to("cuda"))
                  if isinstance(v, torch.Tensor) else v
                  for k, v in batch.items() if k not in LOSS_KEYS}
        unguarded_segment_counts(inputs.get("cu_seq_lens_q"), inputs.get("cu_seq_lens_k"))
        cu = batch.get("packed_cu_seq_lens")
        with packed_attention(model, impl, None if cu is None else cu.cuda(), batch.get("packed_max_length")):
            logits = model(**inputs, use_cache=False).logits
            logits.float().square().mean().backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    print(f"GPU_RECOMPILES_RESULT layers: unique graphs after each layout {graphs}")
    assert graphs[0] == 1 and graphs[-1] == 1, graphs
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_short_row_after_long_ones_compiles_no_inductor_layer_again_on_a_gpu():
    """A rank's last row in a step where it ran out of segments is short (on 2 x H200, Qwen3-VL-2B: fill 0.34 of
    8192 tokens, beside a filler row); the layers first compiled on full rows recompiled there, on Triton's mix-order
    reduction guard (taken for rows of at least 4096 tokens and 5 Mi elements: 40960 tokens at the tiny model's width
    128). ``trainer.modeling.compile.LENGTH_AGNOSTIC_INDUCTOR`` keeps it off the row length: one graph for a 45056-token
    row, then rows of 1000 and 300 tokens."""
    from torch._dynamo.utils import counters

    import tests.unit.test_compile_recompiles as layouts
    from trainer.modeling.compile import compile_decoder_layers
    from trainer.modeling.fixtures import build_tiny_model
    from trainer.packing.packed_batch import pack_targets
    from trainer.packing.varlen_attention import packed_attention, register_varlen_attention
    from trainer.sft.forward import LOSS_KEYS

    torch._dynamo.reset()
    counters.clear()
    model, _ = build_tiny_model("vl", seed=0)
    model = model.to("cuda", torch.bfloat16).train()
    assert model.config.get_text_config().hidden_size == 128
    impl = register_varlen_attention("op")
    compile_decoder_layers(model)
    rng = random.Random(0)
    graphs = []
    for i, layout in enumerate([[(4096, 1)] + [(4096, 0)] * 10, [(1000, 1)], [(300, 1)]]):
        targets = [layouts._target(rng, model.config, n, images, f"r{i}s{j}") for j, (n, images) in enumerate(layout)]
        batch = pack_targets(targets, impl, model, model.config.image_token_id)
        inputs = {k: (v.to("cuda", torch.bfloat16) if torch.is_floating_point(v) else v.to("cuda"))
                  if isinstance(v, torch.Tensor) else v
                  for k, v in batch.items() if k not in LOSS_KEYS}
        with packed_attention(model, impl, batch["packed_cu_seq_lens"].cuda(), batch["packed_max_length"]):
            logits = model(**inputs, use_cache=False).logits
            logits.float().square().mean().backward()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    print(f"GPU_RECOMPILES_RESULT long then short rows: unique graphs after each row {graphs}")
    assert graphs == [1, 1, 1], graphs
