"""Zero recompiles after the first step: the compiled decoder layers (``training.compile_decoder_layers``) of a tiny
Qwen3-VL, fed the packed rows ``pack_targets`` makes with the packed varlen op, compile once over 50 random pack
layouts, among them a row of one segment, a row holding one image, a row with no image and the longest row
(``packing_length`` tokens). Counted with a counting backend around AOTAutograd (the guards Inductor's tracing
adds are AOTAutograd's) and Dynamo's own graph count, which the trainer logs (``compile/new_graphs``,
``compile/recompiles_after_first_step``)."""

from __future__ import annotations

import random

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from trainer.matching.targets import TrainTarget
from trainer.modeling.compile import compile_decoder_layers
from trainer.modeling.fixtures import build_tiny_model
from trainer.packing.packed_batch import pack_targets
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention, unguarded_segment_counts
from trainer.sft.forward import LOSS_KEYS

CAPACITY = 96
#: the tiny model's 64 x 64 image: a 4 x 4 patch grid, merged 2 x 2 into 4 image tokens
GRID = torch.tensor([[1, 4, 4]])
PATCH_VALUES = 3 * 2 * 16 * 16


def _target(rng: random.Random, config, length: int, images: int, name: str) -> TrainTarget:
    """A segment of ``length`` tokens: ``images`` images (a vision-start token and 4 image tokens each) after a
    prompt token, random text after them, the second half supervised."""
    ids = [rng.randrange(100, 1000)]
    for _ in range(images):
        ids += [config.vision_start_token_id] + [config.image_token_id] * 4
    ids += [rng.randrange(100, 1000) for _ in range(length - len(ids))]
    half = length // 2
    mm = {"pixel_values": torch.randn(16 * images, PATCH_VALUES), "image_grid_thw": GRID.repeat(images, 1)} \
        if images else {}
    return TrainTarget(name, ids, [-100] * half + ids[half:], [], [], half, half, 0, mm_inputs=mm)


def _layouts(rng: random.Random) -> list[list[tuple[int, int]]]:
    """50 rows as ``(length, images)`` per segment: a typical first row, then one segment with one image, one
    segment without, a row with no image, a row of one image among text segments, the longest row, then random."""
    special = [[(30, 1), (25, 1), (20, 1)], [(40, 1)], [(40, 0)], [(20, 0), (30, 0)], [(20, 0), (18, 1), (9, 0)],
               [(48, 1), (48, 2)]]
    rows = list(special)
    while len(rows) < 50:
        segments, room = [], CAPACITY
        for _ in range(rng.randint(1, 5)):
            images = rng.choice((0, 1, 1, 2))
            if room < 6 + 5 * images:
                break
            length = rng.randint(6 + 5 * images, min(room, 60))
            segments.append((length, images))
            room -= length
        rows.append(segments or [(12, 1)])
    assert sum(n for n, _ in special[-1]) == CAPACITY
    return rows


def test_fifty_pack_layouts_compile_the_layers_once():
    """A row without an image used to reach the layers with the segment bounds as keyword arguments and text
    position ids where rows with images had the side channel and none: a second graph (``pack_targets`` now gives a
    multimodal model's rows one layout). Adapters inside compiled layers: ``tests/integration/
    test_compiled_packed_layers.py``."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, _ = build_tiny_model("vl", seed=0)
    model.train()
    config = model.config
    impl = register_varlen_attention("op")
    counter = CompileCounterWithBackend("aot_eager")
    assert compile_decoder_layers(model, backend=counter) == 2
    rng = random.Random(0)
    frames = []
    for i, layout in enumerate(_layouts(rng)):
        targets = [_target(rng, config, n, images, f"r{i}s{j}") for j, (n, images) in enumerate(layout)]
        batch = pack_targets(targets, impl, model, config.image_token_id)
        inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
        unguarded_segment_counts(batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k"))
        with packed_attention(model, impl, batch.get("packed_cu_seq_lens"), batch.get("packed_max_length")):
            logits = model(**inputs, use_cache=False).logits
            logits.float().square().mean().backward()
        frames.append(counter.frame_count)
    assert frames[0] >= 1, "the layers ran compiled"
    assert frames[-1] == frames[0], f"recompiled at rows {[i for i in range(1, 50) if frames[i] > frames[i - 1]]}"
    assert counters["stats"]["unique_graphs"] == 1, "the two layers share one graph, compiled once"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_trainer_logs_the_graphs_compiled_after_its_first_step(tmp_path, monkeypatch):
    """``compile/recompiles_after_first_step``: graphs compiled from the second step on, summed since (what the benches
    report); ``compile/new_graphs``: those since the previous record. Dynamo's count is faked: 3 graphs compiled in
    the first step, 2 more at the end of the second."""
    from transformers import TrainerCallback

    from tests.tiny_trainer import tiny_stage2_trainer

    graphs = {"n": 0}
    monkeypatch.setattr("trainer.sft.trainer.compiled_graphs", lambda: graphs["n"])

    class Compiles(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                graphs["n"] = 3

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                graphs["n"] = 5

    trainer = tiny_stage2_trainer(tmp_path, records=6, max_steps=3, target_source="ground_truth",
                                  callbacks=[Compiles()])
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["compile/new_graphs"] for r in rows] == [3.0, 2.0, 0.0]
    assert [r["compile/recompiles_after_first_step"] for r in rows] == [0.0, 2.0, 2.0]
