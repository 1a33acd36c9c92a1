"""Session 29 (`nvidia-h200` then `nvidia-h200-x2`; no H100 kind was lent). Run from the repository root; prints the
tables (`table.txt`).

One H200 (calls 1-3 back to back on one held machine after the bundle's six stashes):
call 1: 8B LoRA r64 at sleep level 2 (compiled, `auto` / `auto`, pixels, recorded load, merge_into_engine), the heap
frozen after the first step (the default since session 28) beside `-nofreeze`, TRL off, 3 steps;
call 2: 4B full beside TRL at the `kv_cache` sleep (compiled, `auto` / `auto`, pixels, recorded load), 3 steps;
call 3: 2B full beside TRL at sleep level 2 (compiled, `auto` / `auto`, pixels, recorded load), 3 steps.
Added to `docs/benchmarks/scale.json` / `.png` with `session: 29`.
Two H200s (call 4): `layouts.sh 345 "colocate-2-r128-pixels-auto-compile-recload"` -> `layouts-session29.json`."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from session_tables import add_scale_records, layouts_table, scale_table  # noqa: E402

layouts_table({4: HERE / "call4"}, session=29, device="2 x NVIDIA H200",
              note="Call 4 of session 29: the shipped colocate learner (pixels, auto, compiled) on two torchrun ranks, "
                   "64 records per engine, the recorded load and the heap freeze on.")
scale_table(add_scale_records([HERE / "call1", HERE / "call2", HERE / "call3"], session=29, device="NVIDIA H200"))
