"""Merge session 17's scale records (2 x H100, `runs/h100x2-session17/call*/gpu*/scale.json`) into
`docs/benchmarks/scale.json` with `session: 17` and redraw `scale.png`; run from the repository root.

Merged: every record that trained (ours, with TRL's side where it ran) and the two Liger + compile records that failed
at the first forward (their error is the finding). Not merged: call 4's `8b-lora64-sleep2-util0.35` (2 steps with the
second profiled: its mean is the warm-up step; it ran for the weight-sync profile only) and call 3's 8B compiled run,
whose scale.json did not come back from the device (its summary lines are in `call3/gpu1.log`)."""

import json
from pathlib import Path

from trainer.bench.scale import plot

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")
SKIP = {("call4", "gpu1", "8b-lora64-sleep2-util0.35")}

result = json.loads(OUT.read_text())
merged = []
for path in sorted(HERE.glob("call*/gpu*/scale.json")):
    call, gpu = path.parts[-3], path.parts[-2]
    device = json.loads(path.read_text())["device"]
    for rec in json.loads(path.read_text())["runs"]:
        if (call, gpu, rec["name"]) in SKIP or rec.get("session") is not None:
            continue
        rec = {**rec, "session": 17, "call": call, "gpu": gpu, "device": device}
        result["runs"] = [r for r in result["runs"] if r.get("name") != rec["name"]] + [rec]
        merged.append(rec["name"])
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))
print("merged:", merged)
