"""Add session 25's scale records (one H100 80GB, `nvidia-h100-x1`, calls 2-4, one held machine) to
`docs/benchmarks/scale.json` with `session: 25`, redraw `scale.png`, and print the side-by-side tables. Run from the
repository root.

Call 2: 4B full, compiled, 16k rows: every layer checkpointed, then no checkpointing with
`training.compile_activation_memory_budget: 0.4` (two bench processes, one after the other, 4 steps each). Call 3:
8B LoRA r64 likewise at budget 0.3 (3 steps each). Call 4: 2B compiled, the packed op then the `api` kernel (4 steps).
Each pair trains the same rows (same seed: equal `batch/tokens` a step)."""

import json
from pathlib import Path

from trainer.bench.scale import plot

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")
#: each call's bench outputs and the size it ran (the outputs of a held machine's later calls also hold the earlier ones)
CALLS = {"call2": (("a", "b"), "4b"), "call3": (("a", "b"), "8b"), "call4": (("",), "2b")}

records = []
for call, (outs, size) in CALLS.items():
    for out in outs:
        for run in json.loads((HERE / call / "records" / out / "scale.json").read_text())["runs"]:
            if not run["name"].startswith(size) or any(r["name"] == run["name"] for r in records):
                continue
            records.append({**run, "session": 25, "call": call, "device": "NVIDIA H100 80GB HBM3"})
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 25] + records
OUT.write_text(json.dumps(result, indent=2))
plot(result, OUT.with_suffix(".png"))

print("| call | run | fwd s | bwd s | opt s | fwd+bwd s (per step) | MFU (per step) | mean MFU | HFU | peak GiB | "
      "step wall s |")
for r in records:
    rows = [json.loads(x) for x in (HERE / r["call"] / "records" / "runs" / r["name"] / "metrics.jsonl")
            .read_text().splitlines()]
    timed = {s["step"] for s in r["timed_steps"]}
    steps = [m for m in rows if "time/forward_s" in m and m["step"] in timed]
    mean = lambda k: sum(m[k] for m in steps) / len(steps)  # noqa: E731
    per = ", ".join(f"{s['fwd_bwd_s']:.3f}" for s in r["timed_steps"])
    mfus = ", ".join(f"{100 * s['mfu']:.1f}" for s in r["timed_steps"])
    hfu = f"{100 * r['hfu']:.1f} %" if r["hfu"] else "-"
    print(f"| {r['call']} | {r['name']} | {mean('time/forward_s'):.3f} | {mean('time/backward_s'):.3f} | "
          f"{mean('time/optimizer_s'):.3f} | {per} | {mfus} | **{100 * r['mfu']:.1f} %** | {hfu} | "
          f"{r['peak_gib']['gpu_mem_peak_gib']:.1f} | {r['step_wall_s']:.2f} |")
    print("   new graphs a step:", [m.get("compile/new_graphs") for m in rows if "time/forward_s" in m],
          "tokens:", [s["tokens"] for s in r["timed_steps"]], "levers:", {k: r["levers"][k] for k in (
              "checkpointing_policy", "compile_activation_memory_budget", "packed_attention") if k in r["levers"]})
