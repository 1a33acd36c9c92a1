"""Add session 19's scale records (4 x H200, `runs/x4-session19/call{1,2}/gpu*/`) to
`docs/benchmarks/scale-h200.json` (each with `session: 19`, its call and card; session 18's records stay) and redraw
`scale-h200.png`; write the layouts call (`call3/layouts.json`) to `docs/benchmarks/layouts-session19.json`. Run from
the repository root.

The lanes' work folders persist across calls on one machine, so a lane's call-2 folder repeats its call-1 run records:
each record is taken once, keyed by (card, name, step wall). A lane's `scale.json` holds its records with TRL's side;
where the limit stopped a lane before it wrote `scale.json` (call 1, GPU 0: 8B with every lever, stopped in TRL's
side), the record is the per-run JSON the bench child wrote before TRL's side started (`runs/<name>.json`), with no
TRL figure. Runs the limit stopped before their child wrote a record (call 2: GPU 0's second 8B run, GPU 1's 8B
selective run) are not records."""

import json
from pathlib import Path

from trainer.bench.layouts import plot as plot_layouts
from trainer.bench.scale import plot

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale-h200.json")

records, seen = [], set()
for call in ("call1", "call2"):
    for gpu_dir in sorted((HERE / call).glob("gpu*")):
        listed = json.loads((gpu_dir / "scale.json").read_text())["runs"] if (gpu_dir / "scale.json").is_file() else []
        names = {r["name"] for r in listed}
        loose = [json.loads(p.read_text()) for p in sorted((gpu_dir / "runs").glob("*.json"))
                 if not p.name.endswith("-trl.json")]
        for rec in listed + [r for r in loose if r["name"] not in names]:
            key = (gpu_dir.name, rec["name"], rec.get("step_wall_s"))
            if key in seen or "per_step" not in rec:
                continue
            seen.add(key)
            records.append({**rec, "session": 19, "call": call, "gpu": gpu_dir.name, "device": "NVIDIA H200"})
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 19] + records
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))
for r in records:
    trl = r.get("trl") or {}
    print(r["call"], r["gpu"], r["name"], "wall", round(r["step_wall_s"], 2), "mfu", round(r["mfu"], 3),
          "hfu", round(r["hfu"], 3), "trl", trl.get("step_wall_s") and round(trl["step_wall_s"], 2),
          (trl.get("trl_over_ours") or {}).get("step_wall"))

layouts = json.loads((HERE / "call3" / "layouts.json").read_text())
out = {**layouts, "session": 19, "device": "4 x NVIDIA H200",
       "note": ("One layouts-bench call on a held nvidia-h200-x4 machine after the two scale calls: bash "
                "docs/benchmarks/runs/h200x4-session16/layouts.sh 555 3v1-sync,colocate-4-r256-pixels. No colocate-1 "
                "ran in this call, so there are no ratios; session 18's colocate-1 (2.33 samples/s) ran on another "
                "machine of the same kind.")}
Path("docs/benchmarks/layouts-session19.json").write_text(json.dumps(out, indent=2) + "\n")
plot_layouts(out, Path("docs/benchmarks/layouts-session19.png"))
