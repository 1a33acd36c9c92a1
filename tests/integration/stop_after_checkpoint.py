"""``python tests/integration/stop_after_checkpoint.py STEP <trainer CLI args>``: ``python -m trainer`` whose learner
stops itself (SIGSTOP) right after writing checkpoint-STEP complete, so a test can SIGKILL it at that point without
racing the next steps (a loaded machine could starve the test's poll long enough for the learner to go on)."""

from __future__ import annotations

import os
import signal
import sys

from trainer.cli import main
from trainer.sft.trainer import RolloutMatchingTrainer

STOP_AT = int(sys.argv.pop(1))
_save = RolloutMatchingTrainer._save_checkpoint


def _save_then_stop(self, model, trial) -> None:
    _save(self, model, trial)
    if self.state.global_step == STOP_AT:
        os.kill(os.getpid(), signal.SIGSTOP)


RolloutMatchingTrainer._save_checkpoint = _save_then_stop

if __name__ == "__main__":
    sys.exit(main())
