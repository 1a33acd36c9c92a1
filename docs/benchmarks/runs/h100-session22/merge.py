"""Add session 22's scale record (one H100 80GB, `nvidia-h100-x1`, call 1:
`bash docs/benchmarks/runs/h100-session21/lane.sh 450 4b-4k-host` after `tests/gpu/test_vision_metadata_gpu.py`) to
`docs/benchmarks/scale.json` with `session: 22`, redraw `scale.png`, and print the side-by-side table. Run from the
repository root.

The second run of the pair (`-devicevision`, `training.host_vision_metadata: false`) reached the call's limit in its
profiled step 4, so the bench wrote no record for it; steps 2-3 are in its `metrics.jsonl`. Both runs train the same
rows (same seed: equal `batch/tokens` a step), so its MFU is the host run's FLOPs of that step over its own seconds."""

import json
from pathlib import Path

from trainer.bench.scale import plot

HERE = Path(__file__).parent / "call1"
OUT = Path("docs/benchmarks/scale.json")
NAME = "4b-full-sleep2-util0.2-compiled-ckptoff-pack4096"

record = {**json.loads((HERE / "scale.json").read_text())["runs"][0], "session": 22, "call": "call1", "gpu": "gpu0",
          "device": "NVIDIA H100 80GB HBM3"}
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 22] + [record]
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))


def steps(name):
    rows = [json.loads(x) for x in (HERE / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "time/forward_s" in r and r["step"] in (2, 3)}


host, device = steps(NAME), steps(NAME + "-devicevision")
flops = {s["step"]: s["mfu"] * s["fwd_bwd_s"] for s in record["timed_steps"]}
print("| host_vision_metadata | step | tokens | fwd s | bwd s | fwd+bwd s | MFU |")
for label, run in (("true", host), ("false", device)):
    for step, m in sorted(run.items()):
        fb = m["time/forward_s"] + m["time/backward_s"]
        print(f"| {label} | {step} | {m['batch/tokens']:.0f} | {m['time/forward_s']:.3f} | {m['time/backward_s']:.3f} |"
              f" {fb:.3f} | {100 * flops[step] / fb:.1f} % |")
    fb = [m["time/forward_s"] + m["time/backward_s"] for m in run.values()]
    print(f"| {label} | mean | | | | {sum(fb) / len(fb):.3f} | |")
print("host syncs in step 4's train region:", [(h["calls"], h["frames"][0].rsplit("/", 1)[-1])
                                                for h in record["profile"]["host_syncs"]])
print("profile: wall", round(record["profile"]["wall_s"], 3), "busy", round(record["profile"]["busy_fraction"], 3),
      "rows", record["profile"]["rows"], "by category", {k: round(v, 3) for k, v in
                                                         record["profile"]["by_category_s"].items()})
