"""What a session's `merge.py` does with its device calls' records (session 29 on; sessions up to 28 kept the same
code in each `merge.py`): merge a layouts call into `layouts-sessionN.json` and print its table, add scale records to
`docs/benchmarks/scale.json` with their session and card, and print the scale table. Run from the repository root."""

import json
from pathlib import Path

from trainer.bench import layouts, scale

SYNC_KEYS = ("time/generate_s", "time/forward_s", "time/backward_s", "time/optimizer_s", "time/target_s",
             "time/sleep_s", "time/wake_s", "time/weight_sync_s", "gc/pause_s")


def layouts_table(call_dirs: dict[int, Path], session: int, device: str, note: str) -> dict:
    """Merge each `call_dir/layouts.json` (keyed by its call number; one held machine, so the ratios may take their
    baseline from another call) into `docs/benchmarks/layouts-session<session>.json` / `.png` and print one row a
    layout: the learner `auto` chose, throughput and its ratios, the step's parts, busy %, peak, losses, ledger and
    per-step sync."""
    out = layouts.merge_calls([d / "layouts.json" for d in call_dirs.values()], list(call_dirs), session=session,
                              device=device, note=note)
    Path(f"docs/benchmarks/layouts-session{session}.json").write_text(json.dumps(out, indent=2) + "\n")
    layouts.plot(out, Path(f"docs/benchmarks/layouts-session{session}.png"))
    print("| layout | learner (auto chose) | trained samples/s | step wall s | fwd + bwd s | generate s | sync s | "
          "busy % | learner peak GiB | losses |")
    for r in out["layouts"]:
        m = r["means"]
        call_dir = call_dirs[r["call"]]
        rows = [json.loads(x) for x in (call_dir / "logs" / "runs" / r["name"] / "metrics.jsonl").read_text()
                .splitlines()]
        losses = ", ".join(f"{x['loss']:.3f}" for x in rows if "loss" in x)
        chose = r["learner_checkpointing"] + (f"@{r['learner_memory_budget']:g}" if r["learner_memory_budget"] else "")
        ratio = f" ({r['speedup_vs_colocate_1']:.2f}x)" if r.get("speedup_vs_colocate_1") else ""
        if r.get("speedup_vs_same_learner_colocate_1"):
            ratio += (f" ({r['speedup_vs_same_learner_colocate_1']:.2f}x the same-levers colocate-1, "
                      f"{r['per_gpu_efficiency_same_learner']:.2f} a GPU)")
        print(f"| {r['name']} | {chose} | {r['trained_samples_per_s']:.2f}{ratio} | {r['step_wall_s']:.2f} | "
              f"{m['time/forward_s']:.2f} + {m['time/backward_s']:.2f} | {m['time/generate_s']:.2f} | "
              f"{m['time/weight_sync_s']:.3f} | {' / '.join(f'{b:.0f}' for b in r['gpu']['busy_pct'])} | "
              f"{r['learner_peak_gib']:.1f} | {losses} |")
        print("   ledger:", r["ledger"])
        print("   per step:", [{k.removeprefix("time/"): round(x[k], 3) for k in x if k in (
            "time/weight_sync_s", "time/sleep_s", "time/wake_s", "time/sync_load_s", "gc/pause_s")} for x in rows])
    return out


def add_scale_records(call_dirs: list[Path], session: int, device: str) -> list[dict]:
    """Add every run of `<call>/records/scale.json` to `docs/benchmarks/scale.json` (tagged with the session, call and
    card; the session's earlier records replaced where they stood) and redraw `scale.png`."""
    records = [{**run, "session": session, "call": d.name, "device": device}
               for d in call_dirs for run in json.loads((d / "records" / "scale.json").read_text())["runs"]]
    result = json.loads(Path("docs/benchmarks/scale.json").read_text())
    at = next((i for i, r in enumerate(result["runs"]) if r.get("session") == session), None)
    kept = [r for r in result["runs"] if r.get("session") != session]
    result["runs"] = kept + records if at is None else kept[:at] + records + kept[at:]
    Path("docs/benchmarks/scale.json").write_text(json.dumps(result, indent=2))
    scale.plot(result, Path("docs/benchmarks/scale.png"))
    return records


def scale_table(records: list[dict]) -> None:
    """One row a scale record: our step wall, TRL's where it ran beside it, the ratios, MFU, memory and the sync."""
    print("\n| call | run | auto chose | ours step wall s (steps) | TRL step wall s (steps) | **TRL / ours** (step by step) | generate | "
          "sync | fwd+bwd | per token | MFU (blocks only) | device used GiB | ours sync s |")
    for r in records:
        t, lv, p = r.get("trl") or {}, r["levers"], r["per_step"]
        ours = ", ".join(f"{s['step_wall_s']:.2f}" for s in r["timed_steps"])
        if t.get("trl_over_ours"):
            ratio = t["trl_over_ours"]
            theirs = f"{t['step_wall_s']:.2f} ({', '.join(f'{s:.2f}' for s in t['step_wall_s_runs'][1:])})"
            lo, hi = scale.step_wall_range(t["step_wall_s_runs"], r["timed_steps"])
            rs = (f"**{ratio['step_wall']:.4f}** ({lo:.2f}-{hi:.2f}) | {ratio['generate']:.2f} | {ratio['weight_sync']:.2f} | "
                  f"{ratio['train_fwd_bwd']:.2f} | {ratio['train_fwd_bwd_per_token']:.2f}")
        else:
            theirs, rs = "-", "- | - | - | - | -"
        print(f"| {r['call']} | {r['name']} | {lv['checkpointing_policy']}@{lv['compile_activation_memory_budget']:g} | "
              f"{r['step_wall_s']:.2f} ({ours}) | {theirs} | {rs} | {100 * r['mfu']:.1f} % "
              f"({100 * r['mfu_blocks']:.1f} %) | {r['peak_gib']['gpu_mem_device_used_gib']:.1f} | "
              f"{p['time/weight_sync_s']:.3f} |")
        print("   ours:", {k.removeprefix("time/"): round(v, 3) for k, v in p.items() if k in SYNC_KEYS},
              "TRL generate:", round(t["blocks_s"]["TimedGRPOTrainer.vLLM.generate"], 3) if t.get("blocks_s") else "-")
        print("   sync parts:", {k: round(v, 3) for k, v in r["sync_parts_s"].items()},
              "cache release:", round(p.get("time/wake_cache_release_s", 0.0), 3))
