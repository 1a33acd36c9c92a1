"""Merge session 16's four layouts-bench calls (one held nvidia-h200-x4 machine, back to back) into
docs/benchmarks/layouts.json / .png; ratios against call 7's colocate-1. Run from the repository root."""
import json
from pathlib import Path

from trainer.bench.layouts import compare, plot

here = Path(__file__).parent
calls = {c: json.loads((here / f"call{c}" / "layouts.json").read_text()) for c in (7, 8, 10, 11)}
works = {json.dumps({k: v for k, v in d["work"].items() if k != "timeout_s"}, sort_keys=True) for d in calls.values()}
assert len(works) == 1, "every call ran the same work (only the per-layout time limit differed)"
order = ["colocate-1", "colocate-4", "colocate-4-r256", "colocate-tp4", "2v2-async", "3v1-async", "3v1-async-kill"]
rows, attempts = {}, []
for c, d in calls.items():
    for r in d["layouts"]:
        r["call"] = c
        if "error" in r:
            attempts.append({"name": r["name"], "call": c, "error": r["error"][:400]})
        else:
            rows[r["name"]] = r
layouts = [rows[n] for n in order]
for r in layouts:
    if r["layout"]["learner_gpus"] > 1:  # this run's code read rank 0's carry only (fixed after it)
        r["ledger"]["unaccounted"] = None
        r["ledger"]["unaccounted_note"] = ("not known: this run recorded rank 0's carry only; ranks 1.. carried the "
                                           "rest (the bench now reads every rank's carried*.jsonl)")
compare(layouts)
first = calls[7]
result = {"work": first["work"], "gpus": first["gpus"], "device": first["device"], "session": 16,
          "note": ("Four calls back to back on one held nvidia-h200-x4 machine (calls 7, 8, 10, 11; the bundle "
                   "install ran in call 7). Each layout ran alone on the machine; colocate-1, the baseline of every "
                   "ratio, ran in call 7. Command per call: bash docs/benchmarks/runs/h200x4-session16/layouts.sh "
                   "LIMIT_S <names>. The H100 run of session 13 is in runs/h100x4-session13/."),
          "failed_attempts": attempts, "layouts": layouts}
Path("docs/benchmarks/layouts.json").write_text(json.dumps(result, indent=2) + "\n")
plot(result, Path("docs/benchmarks/layouts.png"))
for r in layouts:
    print(r["name"], round(r["trained_samples_per_s"], 2), r.get("speedup_vs_colocate_1"), r.get("per_gpu_efficiency"))
