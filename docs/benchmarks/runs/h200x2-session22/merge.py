"""Write session 22's layouts calls (2 x H200: `nvidia-h100-x2` answered with H200s) to
`docs/benchmarks/layouts-session22.json` and draw `layouts-session22.png`. Run from the repository root.

Four calls back to back on one held machine, each `bash docs/benchmarks/runs/h200x4-session16/layouts.sh LIMIT NAMES`:
call 1 "colocate-1,colocate-2" (560), call 2 "1v1-async" (330), call 3 "1v1-sync" (250, then the two-rank GPU pytest
`gpu_tests.sh 150 every_row_on_every_rank`), call 4 "colocate-tp2" (260). Every ratio is against call 1's colocate-1:
the same machine, not the same call, for the layouts of calls 2-4."""

import json
from pathlib import Path

from trainer.bench.layouts import merge_calls, plot

HERE = Path(__file__).parent
out = merge_calls([HERE / f"call{i}" / "layouts.json" for i in (1, 2, 3, 4)], session=22, device="2 x NVIDIA H200",
                  note=("Four layouts-bench calls back to back on one held machine (2 x H200). colocate-1 and "
                        "colocate-2 ran in call 1; 1v1-async, 1v1-sync and colocate-tp2 in calls 2-4, each alone. "
                        "Ratios are against call 1's colocate-1."))
Path("docs/benchmarks/layouts-session22.json").write_text(json.dumps(out, indent=2) + "\n")
plot(out, Path("docs/benchmarks/layouts-session22.png"))
for r in out["layouts"]:
    m = r["means"]
    print(r["call"], r["name"], "samples/s", round(r["trained_samples_per_s"], 3), "x1", r.get("speedup_vs_colocate_1"),
          "per-GPU", r.get("per_gpu_efficiency"), "step", round(r["step_wall_s"], 2), "generate",
          round(m["time/generate_s"], 2), "encode", m.get("time/encode_s"), "fwd+bwd", round(m["time/forward_s"], 2),
          round(m["time/backward_s"], 2), "idle%", r.get("learner_idle_pct"))
