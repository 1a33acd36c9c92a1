"""One optimizer step's rows (``trainer.packing.step_rows``) and the loss normalisation that makes a step trained as
several rows equal the same segments trained as one row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_supervised_logits import _setup
from trainer.losses.objective import LossWeights
from trainer.matching.targets import TrainTarget
from trainer.packing.buffer import PackingBuffer
from trainer.packing.packed_batch import pack_targets
from trainer.packing.step_rows import chunk_rows, plan_step_rows, rows_needed, step_denominators
from trainer.sft.forward import forward_loss


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=40), st.integers(100, 300), st.integers(0, 6))
def test_plan_invariants(lengths, capacity, min_rows):
    plan = plan_step_rows(lengths, capacity, min_rows)
    placed = [i for row in plan.rows for i in row] + plan.carried
    assert sorted(placed) == list(range(len(lengths))), "every segment in exactly one row or the carry, never split"
    assert all(sum(lengths[i] for i in row) <= capacity and row == sorted(row) for row in plan.rows)
    assert plan.carried == sorted(plan.carried)
    assert sum(lengths[i] for i in plan.carried) < capacity, "the carry holds less than one row"
    assert len(plan.rows) >= min(min_rows, 1 if lengths else 0)
    if len(plan.rows) < min_rows:
        assert not plan.carried, "rows short of min_rows only when the segments ran out"
    if plan.rows:
        assert 0 in plan.rows[0], "the oldest segment is in the first row (no starvation)"


def test_a_step_trains_every_whole_row_it_fills():
    lengths = [600] * 13  # 7,800 tokens, capacity 2,048: three rows of 3 and a carry of 4 (2,400 > 2,048 -> 4th row)
    plan = plan_step_rows(lengths, 2048)
    assert [len(r) for r in plan.rows] == [3, 3, 3, 3] and plan.carried == [12]
    assert rows_needed(lengths, 2048) == 4
    assert rows_needed([], 2048) == 0
    few = plan_step_rows([100, 200], 2048)
    assert few.rows == [[0, 1]] and few.carried == [], "a step always trains at least one row"
    forced = plan_step_rows([600] * 7, 2048, min_rows=3)
    assert [len(r) for r in forced.rows] == [3, 3, 1] and not forced.carried, \
        "a rank asked for more rows than it needs drains its carry into them"
    short = plan_step_rows([600] * 5, 2048, min_rows=3)
    assert len(short.rows) == 2 and not short.carried, "segments ran out: the caller runs a filler for the third"


def test_chunk_rows_and_denominators():
    assert chunk_rows(5, 2) == [[0, 1], [2, 3], [4]]
    assert chunk_rows(0, 3) == []
    d = step_denominators([3, 4], [0, 0])
    assert (d.ce, d.coord) == (7, 1)


def _fake(sample_id: str, n: int) -> TrainTarget:
    return TrainTarget(sample_id, list(range(n)), [-100] * n, [], [], 1, 0, n - 1)


def test_buffer_pop_rows_keeps_less_than_a_row():
    buf = PackingBuffer(1000, 64)
    buf.add([_fake(f"s{i}", 300) for i in range(11)])
    rows, stats = buf.pop_rows()
    assert stats.rows == len(rows) == 3 and stats.segments == 9 and stats.carried == 2
    assert stats.capacity == 3000 and stats.tokens == 2700
    assert [t.sample_id for t in buf.segments] == ["s9", "s10"]
    trained = [t.sample_id for r in rows for t in r]
    assert trained == [f"s{i}" for i in range(9)], "rows in the order made, each in insertion order"


def _step_loss_and_grads(model, batches, coord_ids, w):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        loss, _, _ = forward_loss(model, b, coord_ids, w, True, model, None)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_a_step_in_several_rows_equals_one_row(kind):
    """The step's rows, each divided by the step's CE / coord totals, give the loss and gradients of one row holding
    every segment; the old per-row means (what HF's accumulation would give) do not."""
    model, tok, targets, coord_ids = _setup(kind)
    assert len(targets) >= 3
    image_token_id = getattr(model.config, "image_token_id", None)
    w = LossWeights()
    one = pack_targets(targets, "sdpa", model, image_token_id)
    one_loss, one_grads = _step_loss_and_grads(model, [one], coord_ids, w)
    groups = [targets[:1], targets[1:]]
    rows = [pack_targets(g, "sdpa", model, image_token_id) for g in groups]
    den = step_denominators([int(r["ce_labels"].numel()) for r in rows], [int(r["coord_targets"].numel()) for r in rows])
    assert int(rows[0]["ce_labels"].numel()) != int(rows[1]["ce_labels"].numel()), "rows of unequal size"
    split = [{**r, "loss_ce_denominator": den.ce, "loss_coord_denominator": den.coord} for r in rows]
    split_loss, split_grads = _step_loss_and_grads(model, split, coord_ids, w)
    assert split_loss == pytest.approx(one_loss, rel=1e-5)
    for name, g in one_grads.items():
        assert torch.allclose(split_grads[name], g, rtol=1e-3, atol=1e-6), name
    _, naive_grads = _step_loss_and_grads(model, rows, coord_ids, w)
    assert not all(torch.allclose(naive_grads[n] / 2, g, rtol=1e-3, atol=1e-6) for n, g in one_grads.items()), \
        "per-row means averaged (HF's accumulation) give other gradients: the comparison can fail"


def test_filler_micro_batch_has_zero_loss_and_zero_gradient():
    model, tok, targets, coord_ids = _setup("text")
    row = pack_targets(targets, "sdpa", model, None)
    model.zero_grad(set_to_none=True)
    loss, terms, _ = forward_loss(model, {**row, "loss_weight": 0.0}, coord_ids, LossWeights(), True, model, None)
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(v == 0.0 for v in terms.values())
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads), "the filler's backward reaches every parameter (DDP's reducer needs it)"
    assert all(float(g.abs().max()) == 0.0 for g in grads)
