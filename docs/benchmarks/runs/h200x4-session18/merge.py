"""Put session 18's scale records (4 x H200, `runs/h200x4-session18/call{1,2}/gpu*/`) into
`docs/benchmarks/scale-h200.json` (each record with `session: 18`, its call and card) and draw `scale-h200.png`; run
from the repository root. `scale.json` stays the H100 table: these ran on H200s, whose figures are not the H100's.

Each lane kept its output folder between the two calls, so a lane's call-2 `scale.json` repeats its call-1 records
(taken once, from call 1), and the one configuration that ran in both calls on one card
(`8b-lora64-sleepkv-util0.35`, GPU 1) had both runs' steps in one `metrics.jsonl`, so the call-2 record's means mixed
them (fixed in the bench since: `scale.fresh_output_dir`). That record is summarised again here from its own last
`steps` rows (`resummarised`). Call 1's GPU 0 ran out of its time limit before writing `scale.json`; its 2B compiled
record is the per-run JSON the bench wrote before TRL's side started (`runs/2b-full-sleep2-util0.3-compiled.json`)."""

import json
from dataclasses import fields
from pathlib import Path

from trainer.bench.scale import ScaleRun, plot, recomputed_fraction, summarise_steps
from trainer.telemetry import read_jsonl

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale-h200.json")


def resummarised(rec: dict, metrics: Path) -> dict:
    rows = [r for r in read_jsonl(metrics) if r.get("phase") == "stage2" and "loss" in r]
    steps = rec["config"]["steps"]
    if len(rows) <= steps:
        return rec
    run = ScaleRun(**{f.name: rec["config"][f.name] for f in fields(ScaleRun) if f.name in rec["config"]})
    fresh = summarise_steps(run, rows[-steps:], "cuda", recomputed_fraction(rec["levers"], True))
    return {**rec, **fresh, "resummarised": f"{len(rows)} stage-2 rows in metrics.jsonl (two runs): the last {steps}"}


records, seen = [], set()
for call in ("call1", "call2"):
    for gpu_dir in sorted((HERE / call).glob("gpu*")):
        found = json.loads((gpu_dir / "scale.json").read_text())["runs"] if (gpu_dir / "scale.json").is_file() else \
            [json.loads(p.read_text()) for p in sorted((gpu_dir / "runs").glob("*.json"))]
        for rec in found:
            key = (gpu_dir.name, rec["name"], rec.get("step_wall_s"))
            if key in seen or "per_step" not in rec:
                continue
            seen.add(key)
            metrics = gpu_dir / "runs" / rec["name"] / "metrics.jsonl"
            if metrics.is_file():
                rec = resummarised(rec, metrics)
            records.append({**rec, "session": 18, "call": call, "gpu": gpu_dir.name, "device": "NVIDIA H200"})
result = {"device": "NVIDIA H200 (4 x H200 host, one bench per card)", "torch": "2.11.0+cu130", "vllm": "0.26.0",
          "runs": records}
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))
print("records:", [(r["call"], r["gpu"], r["name"], round(r["step_wall_s"], 2), r.get("resummarised", "")) for r in records])

# the layouts bench: call 3 (colocate-1, colocate-4-zero2; its limit stopped colocate-1-pixels) and call 4
# (colocate-1-pixels alone), back to back on the same held machine; ratios against call 3's colocate-1
from trainer.bench.layouts import compare  # noqa: E402
from trainer.bench.layouts import plot as plot_layouts  # noqa: E402

calls = {c: json.loads((HERE / c / "layouts.json").read_text()) for c in ("call3", "call4")}
assert calls["call3"]["work"] == calls["call4"]["work"] or {k: v for k, v in calls["call3"]["work"].items()
                                                            if k != "timeout_s"} == \
    {k: v for k, v in calls["call4"]["work"].items() if k != "timeout_s"}
rows = {}
for c, d in calls.items():
    for r in d["layouts"]:
        if r.get("trained_samples_per_s"):
            rows[r["name"]] = {**r, "call": c}
layouts = [rows[n] for n in ("colocate-1", "colocate-1-pixels", "colocate-4-zero2")]
compare(layouts)
out = {"work": calls["call3"]["work"], "gpus": 4, "device": "4 x NVIDIA H200", "session": 18,
       "note": ("Two layouts-bench calls back to back on one held nvidia-h200-x4 machine after the scale calls: "
                "bash docs/benchmarks/runs/h200x4-session16/layouts.sh 500 colocate-1,colocate-1-pixels,"
                "colocate-4-zero2 (call 3: the 500 s limit stopped colocate-1-pixels, 3v1-sync never started), then "
                "... 225 colocate-1-pixels (call 4). Ratios against call 3's colocate-1. Session 16's table is "
                "layouts.json."),
       "layouts": layouts}
Path("docs/benchmarks/layouts-session18.json").write_text(json.dumps(out, indent=2) + "\n")
plot_layouts(out, Path("docs/benchmarks/layouts-session18.png"))
for r in layouts:
    print(r["name"], round(r["trained_samples_per_s"], 2), r.get("speedup_vs_colocate_1"), r.get("per_gpu_efficiency"),
          {k: round(v, 3) for k, v in r["means"].items() if isinstance(v, float) and k.startswith("time/")})
