"""Post-rollout packing: deterministic selection, cap, carry, exactly-once, and packed == un-packed losses."""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.losses.objective import LossWeights, per_segment_losses
from trainer.matching.targets import TrainTarget
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.batching import pad_targets
from trainer.packing.buffer import PackingBuffer, PackingBufferFull
from trainer.packing.packed_batch import block_causal_mask, pack_targets
from trainer.packing.select import SegmentTooLongError, fifo_greedy, select_segments
from trainer.sft.forward import LOSS_KEYS
from trainer.sft.stage2 import Stage2Pipeline


def fake(sample_id: str, n: int) -> TrainTarget:
    return TrainTarget(sample_id, list(range(n)), [-100] * n, [], [], 1, 0, n - 1)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=12), capacity=st.integers(100, 300))
def test_selection_invariants(lengths, capacity):
    chosen = select_segments(lengths, capacity)
    assert chosen == sorted(set(chosen)) and chosen[0] == 0
    total = sum(lengths[i] for i in chosen)
    assert total <= capacity
    assert total >= sum(lengths[i] for i in fifo_greedy(lengths, capacity))
    assert chosen == select_segments(list(lengths), capacity)


def test_binpacking_beats_fifo_when_it_can():
    assert fifo_greedy([38, 58, 59, 14, 33], 100) == [0, 1]
    assert select_segments([38, 58, 59, 14, 33], 100) == [0, 2]
    assert select_segments([50, 30, 40, 10], 100) == [0, 2], "equal totals: fewer segments win"


def test_segment_longer_than_capacity_fails():
    with pytest.raises(SegmentTooLongError):
        select_segments([10, 500], 100)
    buf = PackingBuffer(100, 8)
    with pytest.raises(ValueError, match="sample 'big'.*packing_length 100"):
        buf.add([fake("big", 101)])


def test_buffer_cap_is_hard_and_says_what_to_do():
    buf = PackingBuffer(100, 3)
    buf.add([fake("a", 10), fake("b", 10)])
    with pytest.raises(PackingBufferFull, match="packing_buffer 3"):
        buf.add([fake("c", 10), fake("d", 10)])


def test_every_segment_trained_exactly_once_and_leftovers_carried():
    rng = random.Random(0)
    buf = PackingBuffer(256, 64, min_fill_ratio=0.5)
    trained: list[str] = []
    carried_seen = 0
    for step in range(30):
        buf.add([fake(f"s{step}-{i}", rng.randint(20, 120)) for i in range(4)])
        rows, stats = buf.pop_rows()
        assert stats.tokens <= 256 * stats.rows and rows and all(sum(t.length for t in r) <= 256 for r in rows)
        carried_seen = max(carried_seen, stats.carried)
        trained += [t.sample_id for r in rows for t in r]
    while len(buf):
        trained += [t.sample_id for r in buf.pop_rows()[0] for t in r]
    assert sorted(trained) == sorted(f"s{s}-{i}" for s in range(30) for i in range(4))
    assert len(trained) == len(set(trained)) and carried_seen > 0


def test_block_causal_mask_never_crosses_segments():
    m = block_causal_mask([2, 3])[0, 0]
    assert m[1, 0] and not m[2, 1] and m[4, 2] and not m[2, 3]
    add = block_causal_mask([2, 3], torch.float32)[0, 0]
    assert add[2, 1] < -1e30 and add[4, 2] == 0


@pytest.mark.parametrize("kind", ["text", "vl"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_and_unpacked_losses_match(kind, impl):
    samples = load_jsonl(generate(tempfile.mkdtemp(), 3, seed=4, max_objects=3))
    model, tok = build_tiny_model(kind, seed=2)
    model.config._attn_implementation = impl
    model.get_decoder().config._attn_implementation = impl
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor() if kind == "vl" else None))
    targets = pipe.ground_truth_targets(samples)
    image_token_id = getattr(model.config, "image_token_id", None)
    coord_ids = torch.tensor(sorted(pipe.coord_bin_by_id, key=pipe.coord_bin_by_id.get))
    padded = pad_targets(targets, tok.pad_token_id, image_token_id)
    packed = pack_targets(targets, impl, model, image_token_id)
    with torch.no_grad():
        lp = model(**{k: v for k, v in padded.items() if k not in LOSS_KEYS}).logits
        lk = model(**{k: v for k, v in packed.items() if k not in LOSS_KEYS}).logits
    assert packed["input_ids"].shape == (1, sum(t.length for t in targets))
    lengths = [t.length for t in targets]
    offsets = [sum(lengths[:i]) for i in range(3)]
    for s in range(3):
        assert (padded["ce_labels"][padded["ce_segment"] == s] == packed["ce_labels"][packed["ce_segment"] == s]).all()
        assert (packed["coord_index"][packed["coord_segment"] == s][:, 1]
                == padded["coord_index"][padded["coord_segment"] == s][:, 1] + offsets[s]).all()
        prompt = targets[s].prompt_len
        assert packed["input_ids"][0, offsets[s]: offsets[s] + prompt].tolist() == targets[s].input_ids[:prompt]
    a = per_segment_losses(lp, padded, coord_ids, LossWeights())
    b = per_segment_losses(lk, packed, coord_ids, LossWeights())
    assert torch.allclose(a, b, atol=1e-4), (a, b)


def test_multimodal_varlen_rows_use_the_side_channel_not_model_kwargs():
    from trainer.packing import varlen_attention as va

    samples = load_jsonl(generate(tempfile.mkdtemp(), 2, seed=4, max_objects=2))
    model, tok = build_tiny_model("vl", seed=2)
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor()))
    targets = pipe.ground_truth_targets(samples)
    batch = pack_targets(targets, va.VARLEN_IMPL, model, model.config.image_token_id)
    lengths = [t.length for t in targets]
    assert batch["packed_cu_seq_lens"].tolist() == [0, lengths[0], sum(lengths)]
    assert batch["packed_max_length"] == max(lengths)
    assert not {"cu_seq_lens_q", "max_length_q"} & batch.keys(), "varlen kwargs would reach the vision encoder"
    assert {"packed_cu_seq_lens", "packed_max_length"} <= set(LOSS_KEYS), "not passed to the model"
    text_cfg, vision_before = model.config.get_text_config(), model.config.vision_config._attn_implementation
    text_before = text_cfg._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with va.packed_attention(model, "eager", batch["packed_cu_seq_lens"], batch["packed_max_length"]):
            assert text_cfg._attn_implementation == "eager"
            assert model.config.vision_config._attn_implementation == vision_before
            assert va._SIDE_CHANNEL["max_len"] == max(lengths)
            raise RuntimeError("boom")
    assert not va._SIDE_CHANNEL and text_cfg._attn_implementation == text_before
