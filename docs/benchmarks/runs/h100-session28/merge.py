"""Session 28 (one H100 80GB, `nvidia-h100-x1`, calls 2-4 on one held machine after the bundle's six stashes and the
GPU tests of call 1). Run from the repository root; prints the tables (`table.txt`).

Call 2: `layouts.sh 560 "colocate-1-auto-compile,colocate-1"` -> `docs/benchmarks/layouts-session28.json` / `.png`.
Call 3: 8B LoRA r64 beside TRL's GRPOTrainer at sleep level 2 (compiled, `auto` / `auto`, pixels during the decode,
recorded load, merge_into_engine), 3 steps. Call 4: 4B full beside TRL at the `kv_cache` sleep (compiled, `auto` /
`auto`, pixels), 3 steps. Both appended to `docs/benchmarks/scale.json` / `.png` with `session: 28`."""

import json
from pathlib import Path

from trainer.bench import layouts, scale

HERE = Path(__file__).parent
DEVICE = "NVIDIA H100 80GB HBM3"

out = layouts.merge_calls([HERE / "call2" / "layouts.json"], [2], session=28, device=f"1 x {DEVICE}",
                          note="Call 2 of session 28: the colocate learner values-colocate.yaml ships (auto, compiled) "
                               "beside every layer checkpointed, eager, on one H100.")
Path("docs/benchmarks/layouts-session28.json").write_text(json.dumps(out, indent=2) + "\n")
layouts.plot(out, Path("docs/benchmarks/layouts-session28.png"))
print("| layout | learner (auto chose) | trained samples/s | step wall s | fwd + bwd s | generate s | sync s | busy % | "
      "learner peak GiB | losses |")
for r in out["layouts"]:
    m = r["means"]
    rows = [json.loads(x) for x in (HERE / "call2" / "logs" / "runs" / r["name"] / "metrics.jsonl").read_text()
            .splitlines()]
    losses = ", ".join(f"{x['loss']:.3f}" for x in rows if "loss" in x)
    chose = r["learner_checkpointing"] + (f"@{r['learner_memory_budget']:g}" if r["learner_memory_budget"] else "")
    print(f"| {r['name']} | {chose} | {r['trained_samples_per_s']:.2f} ({r['speedup_vs_colocate_1']:.2f}x) | "
          f"{r['step_wall_s']:.2f} | {m['time/forward_s']:.2f} + {m['time/backward_s']:.2f} | "
          f"{m['time/generate_s']:.2f} | {m['time/weight_sync_s']:.3f} | {r['gpu']['busy_pct'][0]:.0f} | "
          f"{r['learner_peak_gib']:.1f} | {losses} |")
    print("   ledger:", r["ledger"])

records = []
for call in ("call3", "call4"):
    for run in json.loads((HERE / call / "records" / "scale.json").read_text())["runs"]:
        records.append({**run, "session": 28, "call": call, "device": DEVICE})
result = json.loads(Path("docs/benchmarks/scale.json").read_text())
result["runs"] = [r for r in result["runs"] if r.get("session") != 28] + records
Path("docs/benchmarks/scale.json").write_text(json.dumps(result, indent=2))
scale.plot(result, Path("docs/benchmarks/scale.png"))

print("\n| call | run | auto chose | ours step wall s (steps) | TRL step wall s (steps) | **TRL / ours** | generate | "
      "sync | fwd+bwd | per token | MFU (blocks only) | device used GiB | ours sync s |")
for r in records:
    t, lv, p = r["trl"], r["levers"], r["per_step"]
    ratio = t["trl_over_ours"]
    ours = ", ".join(f"{s['step_wall_s']:.2f}" for s in r["timed_steps"])
    theirs = ", ".join(f"{s:.2f}" for s in t["step_wall_s_runs"][1:])
    print(f"| {r['call']} | {r['name']} | {lv['checkpointing_policy']}@{lv['compile_activation_memory_budget']:g} | "
          f"{r['step_wall_s']:.2f} ({ours}) | {t['step_wall_s']:.2f} ({theirs}) | **{ratio['step_wall']:.4f}** | "
          f"{ratio['generate']:.2f} | {ratio['weight_sync']:.2f} | {ratio['train_fwd_bwd']:.2f} | "
          f"{ratio['train_fwd_bwd_per_token']:.2f} | {100 * r['mfu']:.1f} % ({100 * r['mfu_blocks']:.1f} %) | "
          f"{r['peak_gib']['gpu_mem_device_used_gib']:.1f} | {p['time/weight_sync_s']:.3f} |")
    print("   ours:", {k.removeprefix("time/"): round(v, 3) for k, v in p.items()
                       if k in ("time/generate_s", "time/forward_s", "time/backward_s", "time/optimizer_s",
                                "time/target_s", "time/sleep_s", "time/wake_s", "time/weight_sync_s")},
          "TRL generate:", round(t["blocks_s"]["TimedGRPOTrainer.vLLM.generate"], 3))
    print("   sync parts:", {k: round(v, 3) for k, v in r["sync_parts_s"].items()},
          "cache release:", round(p.get("time/wake_cache_release_s", 0.0), 3))
