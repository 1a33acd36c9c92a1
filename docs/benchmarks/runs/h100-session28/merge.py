"""Session 28 (one H100 80GB, `nvidia-h100-x1`, calls 2-4 on one held machine after the bundle's six stashes and the
GPU tests of call 1). Run from the repository root; prints the tables (`table.txt`).

Call 2: `layouts.sh 560 "colocate-1-auto-compile,colocate-1"` -> `docs/benchmarks/layouts-session28.json` / `.png`.
Call 3: 8B LoRA r64 beside TRL's GRPOTrainer at sleep level 2 (compiled, `auto` / `auto`, pixels during the decode,
recorded load, merge_into_engine), 3 steps. Call 4: 4B full beside TRL at the `kv_cache` sleep (compiled, `auto` /
`auto`, pixels), 3 steps. Both added to `docs/benchmarks/scale.json` / `.png` with `session: 28`.
(Written out in full until session 29; now through the shared `runs/session_tables.py`.)"""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from session_tables import add_scale_records, layouts_table, scale_table  # noqa: E402

DEVICE = "NVIDIA H100 80GB HBM3"
layouts_table(HERE / "call2", 2, session=28, device=f"1 x {DEVICE}",
              note="Call 2 of session 28: the colocate learner values-colocate.yaml ships (auto, compiled) beside every "
                   "layer checkpointed, eager, on one H100.")
scale_table(add_scale_records([HERE / "call3", HERE / "call4"], session=28, device=DEVICE))
