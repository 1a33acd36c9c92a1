"""Python's heap over a training run: what lives for the whole run is frozen out of the garbage collector's walks.

A full collection walks every tracked object that is not frozen. vLLM's sleep mode runs one on the learner's heap at
each level-1/2 sleep (0.32 also at each wake), so every object the run keeps adds to every step. ``run_training``
freezes the setup (model, engine, data index) before training, and, with ``training.freeze_heap_after_first_step``,
once more when the stage's first optimizer step ends: that step builds what the run keeps from then on (compiled
decoder layers: Dynamo's and Inductor's caches; the optimizer's state). ``run_training`` unfreezes when training ends.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger(__name__)


def freeze_setup_objects() -> int:
    """Collect, then move every object alive now out of the collector's reach (``gc.freeze``); returns how many
    objects are frozen in all. Cyclic garbage later made of these objects is not collected until ``gc.unfreeze``."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class FreezeAfterFirstStep(TrainerCallback):
    """``freeze_setup_objects`` once, when the first optimizer step of the trainer it is installed in ends.
    ``frozen``: the frozen object count after it ran (None before)."""

    def __init__(self) -> None:
        self.frozen: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.frozen is None:
            before = gc.get_freeze_count()
            self.frozen = freeze_setup_objects()
            log.info("froze the heap after the first optimizer step: %d more objects out of the collector's walks "
                     "(%d in all; training.freeze_heap_after_first_step)", self.frozen - before, self.frozen)


def install_first_step_freeze(trainer: Any) -> FreezeAfterFirstStep:
    """Put a ``FreezeAfterFirstStep`` first in ``trainer``'s callbacks, ahead of the step clock's
    (``trainer.telemetry.install_step_clock``), so the freeze's own collection counts in the first step's wall
    (the warm-up), not the second's."""
    callback = FreezeAfterFirstStep()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
