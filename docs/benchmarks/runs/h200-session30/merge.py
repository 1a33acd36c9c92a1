"""Session 30 (`nvidia-h200-x2`; no H100 kind was lent). Run from the repository root; prints the tables
(`table.txt`). One held machine, the bundle's six stashes, then three calls back to back:
call 1: `layouts.sh 562 "colocate-1-pixels-auto-compile-recload,colocate-2-r128-pixels-auto-compile-recload"`;
call 2: `layouts.sh 575 "colocate-1-auto-compile,1v1-async-auto-compile"`;
call 1 and 2 -> `layouts-session30.json` / `.png` (each layout against the colocate-1 with the same levers);
call 3 (one of the two GPUs): 8B LoRA r64 at sleep level 2 (compiled, `auto` / `auto`, pixels, recorded load,
merge_into_engine), `RM_BENCH_SCALE_GCFREEZE=0,1`: session 29's freeze pair in the other order, TRL off, 3 steps ->
`docs/benchmarks/scale.json` / `.png` with `session: 30`."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from session_tables import add_scale_records, layouts_table, scale_table  # noqa: E402

layouts_table({1: HERE / "call1", 2: HERE / "call2"}, session=30, device="2 x NVIDIA H200",
              note="Session 30, one held 2 x H200: the shipped colocate learner on one and two ranks (64 records per "
                   "engine; pixels, auto, compiled, recorded load), and 1v1 async beside colocate-1 with the same "
                   "learner (auto, compiled).")
scale_table(add_scale_records([HERE / "call3"], session=30, device="NVIDIA H200"))
