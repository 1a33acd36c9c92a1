"""Add session 27's scale records (one H100 80GB, `nvidia-h100-x1`, calls 2-3 on one held machine) to
`docs/benchmarks/scale.json` with `session: 27`, redraw `scale.png`, and print the tables (`table.txt`). Run from the
repository root.

Call 2: 8B LoRA r64, compiled, 16k rows, `gradient_checkpointing_policy: auto` with
`compile_activation_memory_budget: auto` (session 26's rule: an engine asleep at level 2 is charged nothing), recorded
load, `vllm.sync.merge_into_engine` off then on (3 steps each, the same rows). Call 3: 4B full, compiled, `auto` /
`auto`, pixels during the decode, level 2, 4 steps (TRL's side did not run: the bundle had no `trl`)."""

import json
from pathlib import Path

from trainer.bench import scale

HERE = Path(__file__).parent
OUT = Path("docs/benchmarks/scale.json")
CALLS = ("call2", "call3")

records = []
for call in CALLS:
    for run in json.loads((HERE / call / "records" / "scale.json").read_text())["runs"]:
        records.append({**run, "session": 27, "call": call, "device": "NVIDIA H100 80GB HBM3"})
result = json.loads(OUT.read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 27] + records
OUT.write_text(json.dumps(result, indent=2))
scale.plot(result, OUT.with_suffix(".png"))


def metrics(call: str, name: str) -> list[dict]:
    path = HERE / call / "records" / "runs" / name / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


print("| call | run | auto chose | fwd s | bwd s | opt s | MFU per step | **MFU** | MFU blocks only | HFU | "
      "device used GiB | torch peak GiB | step wall s | sync s |")
for r in records:
    p, lv = r["per_step"], r["levers"]
    mfus = ", ".join(f"{100 * s['mfu']:.1f}" for s in r["timed_steps"])
    chose = f"{lv['checkpointing_policy']}@{lv['compile_activation_memory_budget']:g}"
    print(f"| {r['call']} | {r['name']} | {chose} | {p['time/forward_s']:.3f} | {p['time/backward_s']:.3f} | "
          f"{r['optimizer_s']:.3f} | {mfus} | **{100 * r['mfu']:.1f} %** | {100 * r['mfu_blocks']:.1f} % | "
          f"{100 * r['hfu']:.1f} % | {r['peak_gib']['gpu_mem_device_used_gib']:.1f} | "
          f"{r['peak_gib']['gpu_mem_peak_gib']:.1f} | {r['step_wall_s']:.2f} | {p['time/weight_sync_s']:.3f} |")
    print("   tokens:", [s["tokens"] for s in r["timed_steps"]], "estimates GiB:",
          {k: round(v, 1) for k, v in lv["checkpointing_estimate_gib"].items() if k.startswith("off")},
          "budget GiB:", round(lv["checkpointing_budget_gib"], 1))

print("\nThe sync, timed steps (call 2: merge_into_engine off / on at 8B; call 3: 4B full, nothing to merge):")
print("| run | sync s per step | learner check | collect | check | wake (cache release) | load (replay) | rest |")
for r in records:
    rows = [m for m in metrics(r["call"], r["name"]) if "time/weight_sync_s" in m and "loss" in m][1:]
    parts = r["sync_parts_s"]
    release = sum(m.get("time/wake_cache_release_s", 0.0) for m in rows) / len(rows)
    replay = sum(m.get("time/sync_load_replay_s", 0.0) for m in rows) / len(rows)
    per = ", ".join(f"{m['time/weight_sync_s']:.3f}" for m in rows)
    print(f"| {r['name']} | {per} | {parts['sync_learner_check']:.3f} | {parts['sync_collect']:.3f} | "
          f"{parts['sync_check']:.3f} | {parts['sync_wake']:.3f} ({release:.3f}) | {parts['sync_load']:.3f} "
          f"({replay:.3f}) | {parts['unaccounted']:.3f} |")
