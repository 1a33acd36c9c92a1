"""Write session 23's layouts calls (4 x H200: `nvidia-h100-x4` answered with H200s) to
`docs/benchmarks/layouts-session23.json` / `.png`. Run from the repository root.

Calls back to back on one held machine, each `bash docs/benchmarks/runs/h200x4-session16/layouts.sh LIMIT NAMES
RM_BENCH_LAYOUT_TIMEOUT_S=...`: call 1 "colocate-1,3v1-async-auto-compile,3v1-async" failed at import (binpacking
was not on the machine; left out here), call 2 the same names (565; the limit cut 3v1-async-auto-compile), call 3
"colocate-1-auto-compile,3v1-async-auto-compile" (580), call 4 "2v2-async-auto-compile" (300)."""

import json
from pathlib import Path

from trainer.bench.layouts import merge_calls, plot

HERE = Path(__file__).parent
out = merge_calls([HERE / f"call{i}" / "layouts.json" for i in (2, 3, 4)], [2, 3, 4], session=23, device="4 x NVIDIA H200",
                  note="Calls 2-4 of session 23 on one held machine; ratios against call 2's colocate-1 and, for the "
                       "auto-compile learner, against call 3's colocate-1-auto-compile (the same machine).")
Path("docs/benchmarks/layouts-session23.json").write_text(json.dumps(out, indent=2) + "\n")
plot(out, Path("docs/benchmarks/layouts-session23.png"))
for r in out["layouts"]:
    m = r["means"]
    print(r["call"], r["name"], round(r["trained_samples_per_s"], 2), r.get("speedup_vs_colocate_1"),
          r.get("per_gpu_efficiency"), r.get("speedup_vs_same_learner_colocate_1"),
          r.get("per_gpu_efficiency_same_learner"), round(r["step_wall_s"], 2), r.get("learner_idle_pct"),
          r["gpu"]["busy_pct"], round(m["time/forward_s"], 2), round(m["time/backward_s"], 2))
