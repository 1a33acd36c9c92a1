"""``trainer.sft.heap``: the heap is frozen once more when the first optimizer step ends, once, ahead of the step
clock (so the freeze's collection counts in the warm-up step's wall)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.sft import heap


class Kept:
    """A tracked object (instances of plain classes are tracked by the collector)."""


def collectable(obj) -> bool:
    """Whether ``obj`` is in one of the collector's generations (a frozen object is in none of them)."""
    return any(o is obj for generation in (0, 1, 2) for o in gc.get_objects(generation))


def test_the_callback_freezes_what_the_first_step_made_once(monkeypatch):
    calls = []
    real = heap.freeze_setup_objects
    monkeypatch.setattr(heap, "freeze_setup_objects", lambda: calls.append(1) or real())
    callback = heap.FreezeAfterFirstStep()
    try:
        made_in_step_1 = Kept()
        assert collectable(made_in_step_1)
        before = gc.get_freeze_count()
        callback.on_step_end(None, SimpleNamespace(global_step=1), None)
        assert len(calls) == 1 and callback.frozen > before and gc.get_freeze_count() > before
        assert collectable(made_in_step_1) is False, "an object alive at the freeze is frozen"
        made_in_step_2 = Kept()
        callback.on_step_end(None, SimpleNamespace(global_step=2), None)
        assert len(calls) == 1, "frozen once, at the first step's end only"
        assert collectable(made_in_step_2), "what later steps make stays collectable"
    finally:
        gc.unfreeze()


def test_the_freeze_runs_before_the_step_clock_ticks_the_first_step(tmp_path, monkeypatch):
    trainer = tiny_stage2_trainer(tmp_path, records=4, max_steps=2)
    seen = []
    real = heap.freeze_setup_objects
    monkeypatch.setattr(heap, "freeze_setup_objects", lambda: seen.append(
        (trainer.state.global_step, len(trainer.step_clock.step_wall_s))) or real())
    callback = heap.install_first_step_freeze(trainer)
    try:
        trainer.train()
    finally:
        gc.unfreeze()
    assert seen == [(1, 0)], "once, at the first step's end, before the clock counted that step's wall"
    assert callback.frozen is not None and len(trainer.step_clock.step_wall_s) == 2
