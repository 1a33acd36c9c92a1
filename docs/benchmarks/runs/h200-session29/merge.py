"""Session 29 (`nvidia-h200` then `nvidia-h200-x2`; no H100 kind was lent). Run from the repository root; prints the
tables (`table.txt`).

One H200 (calls 1-3 back to back on one held machine after the bundle's six stashes):
call 1: 8B LoRA r64 at sleep level 2 (compiled, `auto` / `auto`, pixels, recorded load, merge_into_engine), the heap
frozen after the first step (the default since session 28) beside `-nofreeze`, TRL off, 3 steps;
call 2: 4B full beside TRL at the `kv_cache` sleep (compiled, `auto` / `auto`, pixels, recorded load), 3 steps;
call 3: 2B full beside TRL at sleep level 2 (compiled, `auto` / `auto`, pixels, recorded load), 3 steps.
Appended to `docs/benchmarks/scale.json` / `.png` with `session: 29`.
Two H200s (call 4): `layouts.sh 345 "colocate-2-r128-pixels-auto-compile-recload"` -> `layouts-session29.json`."""

import json
from pathlib import Path

from trainer.bench import layouts, scale

HERE = Path(__file__).parent
DEVICE = "NVIDIA H200"

out = layouts.merge_calls([HERE / "call4" / "layouts.json"], [4], session=29, device=f"2 x {DEVICE}",
                          note="Call 4 of session 29: the shipped colocate learner (pixels, auto, compiled) on two "
                               "torchrun ranks, 64 records per engine, the recorded load and the heap freeze on.")
Path("docs/benchmarks/layouts-session29.json").write_text(json.dumps(out, indent=2) + "\n")
layouts.plot(out, Path("docs/benchmarks/layouts-session29.png"))
print("| layout | learner (auto chose) | trained samples/s | step wall s | fwd + bwd s | generate s | sync s | busy % | "
      "learner peak GiB | losses |")
for r in out["layouts"]:
    m = r["means"]
    rows = [json.loads(x) for x in (HERE / "call4" / "logs" / "runs" / r["name"] / "metrics.jsonl").read_text()
            .splitlines()]
    losses = ", ".join(f"{x['loss']:.3f}" for x in rows if "loss" in x)
    chose = r["learner_checkpointing"] + (f"@{r['learner_memory_budget']:g}" if r["learner_memory_budget"] else "")
    print(f"| {r['name']} | {chose} | {r['trained_samples_per_s']:.2f} | "
          f"{r['step_wall_s']:.2f} | {m['time/forward_s']:.2f} + {m['time/backward_s']:.2f} | "
          f"{m['time/generate_s']:.2f} | {m['time/weight_sync_s']:.3f} | "
          f"{' / '.join(f'{b:.0f}' for b in r['gpu']['busy_pct'])} | {r['learner_peak_gib']:.1f} | {losses} |")
    print("   ledger:", r["ledger"])
    print("   per step:", [{k.removeprefix("time/"): round(x[k], 3) for k in x if k in (
        "time/weight_sync_s", "time/sleep_s", "time/wake_s", "time/sync_load_s", "gc/pause_s")} for x in rows])

records = []
for call in ("call1", "call2", "call3"):
    for run in json.loads((HERE / call / "records" / "scale.json").read_text())["runs"]:
        records.append({**run, "session": 29, "call": call, "device": DEVICE})
result = json.loads(Path("docs/benchmarks/scale.json").read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 29] + records
Path("docs/benchmarks/scale.json").write_text(json.dumps(result, indent=2))
scale.plot(result, Path("docs/benchmarks/scale.png"))

print("\n| call | run | auto chose | ours step wall s (steps) | TRL step wall s (steps) | **TRL / ours** | generate | "
      "sync | fwd+bwd | per token | MFU (blocks only) | device used GiB | ours sync s |")
for r in records:
    t, lv, p = r.get("trl") or {}, r["levers"], r["per_step"]
    ours = ", ".join(f"{s['step_wall_s']:.2f}" for s in r["timed_steps"])
    if t.get("trl_over_ours"):
        ratio = t["trl_over_ours"]
        theirs = f"{t['step_wall_s']:.2f} ({', '.join(f'{s:.2f}' for s in t['step_wall_s_runs'][1:])})"
        rs = (f"**{ratio['step_wall']:.4f}** | {ratio['generate']:.2f} | {ratio['weight_sync']:.2f} | "
              f"{ratio['train_fwd_bwd']:.2f} | {ratio['train_fwd_bwd_per_token']:.2f}")
    else:
        theirs, rs = "-", "- | - | - | - | -"
    print(f"| {r['call']} | {r['name']} | {lv['checkpointing_policy']}@{lv['compile_activation_memory_budget']:g} | "
          f"{r['step_wall_s']:.2f} ({ours}) | {theirs} | {rs} | {100 * r['mfu']:.1f} % ({100 * r['mfu_blocks']:.1f} %) | "
          f"{r['peak_gib']['gpu_mem_device_used_gib']:.1f} | {p['time/weight_sync_s']:.3f} |")
    print("   ours:", {k.removeprefix("time/"): round(v, 3) for k, v in p.items()
                       if k in ("time/generate_s", "time/forward_s", "time/backward_s", "time/optimizer_s",
                                "time/target_s", "time/sleep_s", "time/wake_s", "time/weight_sync_s", "gc/pause_s")},
          "TRL generate:", round(t["blocks_s"]["TimedGRPOTrainer.vLLM.generate"], 3) if t.get("blocks_s") else "-")
    print("   sync parts:", {k: round(v, 3) for k, v in r["sync_parts_s"].items()},
          "cache release:", round(p.get("time/wake_cache_release_s", 0.0), 3))
    print("   per step:", [{k: round(v, 3) for k, v in s.items() if k in (
        "step_wall_s", "time/weight_sync_s", "time/sleep_s", "gc/pause_s", "gc/collections_gen2")} for s in r["timed_steps"]])
