"""Add session 26's scale records (one H100 80GB, `nvidia-h100-x1`, calls 2-3, one held machine) to
`docs/benchmarks/scale.json` with `session: 26`, redraw `scale.png`, and print the tables (`table.txt`). Run from the
repository root.

Call 2: 8B LoRA r64, compiled, 16k rows, no checkpointing at `compile_activation_memory_budget: 0.5`, recorded load,
`vllm.sync.overlap_wake` off then on (3 steps each). Call 3: the same 8B at budget 0.6 (overlap off), then 4B full at
0.4 (session 25's best 4B run, again). Every run trains the same rows (same seed: equal `batch/tokens` a step).
Also printed: session 25's six records recounted with this session's FLOP count (the LM head over the rows it
projects), from their own metrics rows, so the two sessions compare on one count."""

import json
from pathlib import Path

from trainer.bench import scale

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")
#: each call's bench outputs, and marks of the run names that call ran (a held machine's later calls also list the
#: earlier runs: each run is taken from the call that ran it)
CALLS = {"call2": (("",), ("membudget0.5",)), "call3": (("a", "b"), ("membudget0.6", "4b-"))}

records = []
for call, (outs, marks) in CALLS.items():
    for out in outs:
        for run in json.loads((HERE / call / "records" / out / "scale.json").read_text())["runs"]:
            if not any(m in run["name"] for m in marks) or any(r["name"] == run["name"] for r in records):
                continue
            records.append({**run, "session": 26, "call": call, "device": "NVIDIA H100 80GB HBM3"})
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 26] + records
OUT.write_text(json.dumps(result, indent=2))
scale.plot(result, OUT.with_suffix(".png"))


def metrics(call_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (call_dir / "records" / "runs" / name / "metrics.jsonl").read_text().splitlines()]


print("| call | run | fwd s | bwd s | opt s | MFU per step | **MFU** | MFU blocks only | HFU | device used GiB | "
      "torch peak GiB | step wall s | sync s |")
for r in records:
    p = r["per_step"]
    mfus = ", ".join(f"{100 * s['mfu']:.1f}" for s in r["timed_steps"])
    print(f"| {r['call']} | {r['name']} | {p['time/forward_s']:.3f} | {p['time/backward_s']:.3f} | {r['optimizer_s']:.3f} | "
          f"{mfus} | **{100 * r['mfu']:.1f} %** | {100 * r['mfu_blocks']:.1f} % | {100 * r['hfu']:.1f} % | "
          f"{r['peak_gib']['gpu_mem_device_used_gib']:.1f} | {r['peak_gib']['gpu_mem_peak_gib']:.1f} | "
          f"{r['step_wall_s']:.2f} | {p['time/weight_sync_s']:.3f} |")
    print("   tokens:", [s["tokens"] for s in r["timed_steps"]], "logit rows:", [s["logit_rows"] for s in r["timed_steps"]],
          "levers:", {k: r["levers"][k] for k in ("checkpointing_policy", "compile_activation_memory_budget")})

print("\nThe 8B sync, steps 2-3 (call 2: overlap_wake off / on; call 3: budget 0.6, off):")
print("| run | sync s per step | learner check | collect | check | wake (cache release) | check wait | load | rest |")
for r in records:
    if not r["name"].startswith("8b"):
        continue
    rows = [m for m in metrics(HERE / r["call"], r["name"]) if "time/weight_sync_s" in m and "loss" in m][1:]
    parts = r["sync_parts_s"]
    release = sum(m.get("time/wake_cache_release_s", 0.0) for m in rows) / len(rows)
    per = ", ".join(f"{m['time/weight_sync_s']:.3f}" for m in rows)
    print(f"| {r['name']} | {per} | "
          f"{parts['sync_learner_check']:.3f} | {parts['sync_collect']:.3f} | {parts['sync_check']:.3f} | "
          f"{parts['sync_wake']:.3f} ({release:.3f}) | {parts.get('sync_check_wait', 0.0):.4f} | "
          f"{parts['sync_load']:.3f} | {parts['unaccounted']:.3f} |")

print("\nSession 25's records recounted (same metrics rows; MFU with the LM head / blocks only, as published then):")
print("| session 25 run | MFU blocks only (published) | MFU with the LM head | steps |")
s25 = HERE.parent / "h100-session25"
for path in sorted(s25.glob("call*/records/runs/*.json")):
    rec = json.loads(path.read_text())
    if "config" not in rec:
        continue
    run = scale.ScaleRun(**rec["config"])
    rows = [m for m in metrics(path.parents[2], rec["name"]) if m.get("phase") == "stage2" and "loss" in m]
    out = scale.summarise_steps(run, rows, "cuda", scale.recomputed_fraction(rec["levers"], True))
    per = ", ".join(f"{100 * t['mfu']:.1f}" for t in out["timed_steps"])
    print(f"| {rec['name']} | {100 * rec['mfu']:.1f} % | **{100 * out['mfu']:.1f} %** | {per} |")
