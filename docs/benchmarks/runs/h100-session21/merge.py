"""Add session 21's scale records (one H100 80GB, `nvidia-h100-x1`, `lane.sh`: calls 1-2 back to back on one held
machine) to `docs/benchmarks/scale.json` (each with `session: 21` and its call; earlier sessions' records stay) and
redraw `scale.png`. Run from the repository root. Call 2's `scale.json` repeats call 1's records (the bench's output
folder persists on a machine): each record is taken once, from call 2's file, and assigned to the call whose log
names it."""

import json
from pathlib import Path

from trainer.bench.scale import plot

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")

made_in = {}
for call in ("call1", "call2"):
    for line in (HERE / call / "gpu0.log").read_text().splitlines():
        if line.startswith("bench scale: "):
            made_in.setdefault(line.removeprefix("bench scale: ").removesuffix(" ...").strip(), call)
records = [{**rec, "session": 21, "call": made_in[rec["name"]], "gpu": "gpu0", "device": "NVIDIA H100 80GB HBM3"}
           for rec in json.loads((HERE / "call2" / "scale.json").read_text())["runs"]]
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 21] + records
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))
for r in records:
    step = r["step_s"]
    print(r["call"], r["name"], "fwd", round(r["split"]["forward"] * step, 3), "bwd",
          round(r["split"]["backward"] * step, 3), "mfu", round(r["mfu"], 3), "hfu", round(r["hfu"], 3),
          "wall", round(r["step_wall_s"], 2), "peak", round(r["peak_gib"]["gpu_mem_peak_gib"], 1),
          "busy", round(r["profile"]["busy_fraction"], 3), "steps", r.get("timed_steps"))
