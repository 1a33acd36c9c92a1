"""``trainer.packing.mrope``: the image rule gives the models' own ``get_rope_index`` positions (Qwen3-VL and
Qwen2.5-VL, many layouts), packing trusts it only after it agreed with the model, and a model whose positions differ
keeps its own, with a warning. ``loss_indices`` (vectorised) equals the per-token loop it replaced."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from trainer.matching.targets import IGNORE_INDEX, TrainTarget
from trainer.packing import mrope
from trainer.packing.batching import loss_indices

IMAGE = 7


def _qwen3_vl():
    from trainer.modeling.fixtures import build_tiny_model

    model, _ = build_tiny_model("vl", seed=0)
    return model


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": 64, "rope_scaling": {"type": "mrope",
                                                                                  "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                       "spatial_merge_size": 2, "patch_size": 14, "fullatt_block_indexes": [0]},
        image_token_id=IMAGE, video_token_id=8, vision_start_token_id=5, vocab_size=64)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def _layout(rng: random.Random, merge: int) -> tuple[list[int], torch.Tensor]:
    """Text runs and 0-3 images of random (non-square) grids, an image first or last now and then; images never
    touch (a chat template wraps each in vision start / end tokens)."""
    ids: list[int] = [] if rng.random() < 0.2 else [rng.randrange(10, 60) for _ in range(rng.randrange(1, 12))]
    grids = []
    for k in range(rng.randrange(0, 4)):
        if k:
            ids += [rng.randrange(10, 60) for _ in range(rng.randrange(1, 4))]
        h, w = merge * rng.randrange(1, 6), merge * rng.randrange(1, 6)
        grids.append([1, h, w])
        ids += [IMAGE] * ((h // merge) * (w // merge))
    if rng.random() < 0.8 or not ids:
        ids += [rng.randrange(10, 60) for _ in range(rng.randrange(1, 9))]
    return ids, (torch.tensor(grids) if grids else None)


@pytest.mark.parametrize("build", [_qwen3_vl, _qwen2_5_vl], ids=["qwen3-vl", "qwen2.5-vl"])
def test_the_rule_gives_the_model_s_own_positions(build):
    model = build()
    image = model.config.image_token_id
    owner = mrope._rope_owner(model)
    merge = owner.config.vision_config.spatial_merge_size
    rng = random.Random(0)
    for _ in range(60):
        ids, grids = _layout(rng, merge)
        ids = [image if i == IMAGE else i for i in ids]
        own = mrope.SegmentPositions.models_own(owner, ids, grids, image)
        assert torch.equal(mrope.segment_positions(ids, image, grids, merge), own), (ids, grids)


def test_packing_trusts_the_rule_only_after_it_agreed(monkeypatch):
    model = _qwen3_vl()
    image = model.config.image_token_id
    owner = mrope._rope_owner(model)
    calls = []
    original = owner.get_rope_index
    monkeypatch.setattr(owner, "get_rope_index", lambda *a, **k: calls.append(1) or original(*a, **k))
    positions = mrope.SegmentPositions()
    ids, grids = [11, 12] + [image] * 4 + [13], torch.tensor([[1, 4, 4]])
    for _ in range(mrope.CHECKED_SEGMENTS + 3):
        positions(model, ids, grids, image)
    positions(model, [11, 12, 13], None, image)  # text only: no check needed, none made
    assert len(calls) == mrope.CHECKED_SEGMENTS


def test_a_model_whose_positions_differ_keeps_its_own(monkeypatch, caplog):
    model = _qwen3_vl()
    image = model.config.image_token_id
    owner = mrope._rope_owner(model)
    original = owner.get_rope_index

    def shifted(*a, **k):
        pos, delta = original(*a, **k)
        return pos + 1, delta

    monkeypatch.setattr(owner, "get_rope_index", shifted)
    positions = mrope.SegmentPositions()
    ids, grids = [11] + [image] * 4 + [13], torch.tensor([[1, 4, 4]])
    with caplog.at_level(logging.WARNING, logger="trainer.packing.mrope"):
        for _ in range(4):
            got = positions(model, ids, grids, image)
            assert torch.equal(got, mrope.SegmentPositions.models_own(owner, ids, grids, image))
    assert "disagree" in caplog.text and caplog.text.count("disagree") == 1


def test_runs_that_do_not_fit_their_grids_are_refused():
    with pytest.raises(ValueError, match="1 image-token runs but 0 image grids"):
        mrope.segment_positions([1, IMAGE, 2], IMAGE, None, 2)
    with pytest.raises(ValueError, match="image run of 3 tokens for grid"):
        mrope.segment_positions([1] + [IMAGE] * 3, IMAGE, torch.tensor([[1, 4, 4]]), 2)


def _reference_loss_indices(targets, rows, offsets):
    """The per-token loop ``loss_indices`` replaced."""
    ce_index, ce_labels, ce_seg, co_index, co_targets, co_seg = [], [], [], [], [], []
    lp_index, lp_engine = [], []
    for seg, (t, r, off) in enumerate(zip(targets, rows, offsets)):
        for c, lp in t.engine_logprobs:
            lp_index.append((r, off + c))
            lp_engine.append(lp)
        for c, lab in enumerate(t.labels):
            if lab != IGNORE_INDEX:
                ce_index.append((r, off + c))
                ce_labels.append(lab)
                ce_seg.append(seg)
        for c, tgt in zip(t.coord_positions, t.coord_targets):
            co_index.append((r, off + c))
            co_targets.append(tgt)
            co_seg.append(seg)
    return {"ce_index": torch.tensor(ce_index, dtype=torch.long).reshape(-1, 2),
            "ce_labels": torch.tensor(ce_labels, dtype=torch.long), "ce_segment": torch.tensor(ce_seg, dtype=torch.long),
            "coord_index": torch.tensor(co_index, dtype=torch.long).reshape(-1, 2),
            "coord_targets": torch.tensor(co_targets, dtype=torch.float32),
            "coord_segment": torch.tensor(co_seg, dtype=torch.long),
            "logp_index": torch.tensor(lp_index, dtype=torch.long).reshape(-1, 2),
            "logp_engine": torch.tensor(lp_engine, dtype=torch.float32)}


def _target(rng: random.Random, i: int) -> TrainTarget:
    n = rng.randrange(2, 40)
    labels = [IGNORE_INDEX] + [rng.randrange(100) if rng.random() < 0.5 else IGNORE_INDEX for _ in range(n - 1)]
    positions = sorted(rng.sample(range(1, n), rng.randrange(0, n - 1)))
    kept = sorted(rng.sample(range(1, n), rng.randrange(0, n - 1)))
    return TrainTarget(f"s{i}", list(range(n)), labels, positions, [rng.random() * 999 for _ in positions], 1, 0, n - 1,
                       engine_logprobs=[(c, -rng.random()) for c in kept])


@pytest.mark.parametrize("packed", [True, False])
def test_loss_indices_equal_the_per_token_loop(packed):
    rng = random.Random(1)
    for _ in range(20):
        targets = [_target(rng, i) for i in range(rng.randrange(0, 6))]
        if packed:
            rows, offsets = [0] * len(targets), [sum(t.length for t in targets[:i]) for i in range(len(targets))]
        else:
            rows, offsets = list(range(len(targets))), [0] * len(targets)
        got, want = loss_indices(targets, rows, offsets), _reference_loss_indices(targets, rows, offsets)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_a_label_on_the_first_token_is_refused():
    t = TrainTarget("bad", [1, 2], [5, IGNORE_INDEX], [], [], 1, 0, 1)
    with pytest.raises(ValueError, match="'bad': the first token cannot carry a label"):
        loss_indices([t], [0], [0])
