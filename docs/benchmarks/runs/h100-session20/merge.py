"""Add session 20's scale records (one H100 80GB, `nvidia-h100-x1`, `lane.sh`: calls 1-4 back to back on one held
machine, calls 5-6 on a second one) to `docs/benchmarks/scale.json` (each with `session: 20` and its call; earlier sessions' records stay) and
redraw `scale.png`. Run from the repository root.

The bench's output folder persists across calls on one machine, so each call's `scale.json` repeats the records of the
calls before it on that machine: every record is taken once, from the last call's file of each machine, and assigned
to the call whose log names it."""

import json
from pathlib import Path

from trainer.bench.scale import plot

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")
CALLS = ("call1", "call2", "call3", "call4", "call5", "call6")
LAST_ON_MACHINE = ("call4", "call6")

made_in = {}
for call in CALLS:
    for line in (HERE / call / "gpu0.log").read_text().splitlines():
        if line.startswith("bench scale: "):
            made_in.setdefault(line.removeprefix("bench scale: ").removesuffix(" ...").strip(), call)
records = []
for last in LAST_ON_MACHINE:
    for rec in json.loads((HERE / last / "scale.json").read_text())["runs"]:
            records.append({**rec, "session": 20, "call": made_in[rec["name"]], "gpu": "gpu0",
                        "device": "NVIDIA H100 80GB HBM3"})
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 20] + records
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))
for r in records:
    trl = r.get("trl") or {}
    print(r["call"], r["name"], "wall", round(r["step_wall_s"], 2), "mfu", round(r["mfu"], 3),
          "hfu", round(r["hfu"], 3), "trl", trl.get("step_wall_s") and round(trl["step_wall_s"], 2),
          (trl.get("trl_over_ours") or {}).get("step_wall"))
