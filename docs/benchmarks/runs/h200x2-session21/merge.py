"""Write session 21's layouts calls (2 x H200, `nvidia-h100-x2` answered with H200s) to
`docs/benchmarks/layouts-session21.json` and draw `layouts-session21.png`. Run from the repository root.

Call 1 (`bash docs/benchmarks/runs/h200x4-session16/layouts.sh 480 "1v1-sync,1v1-sync-pixels,colocate-2"`) finished
colocate-2 and 1v1-sync; the limit stopped 1v1-sync-pixels. Call 2, on the same held machine right after it, ran
1v1-sync-pixels alone (limit 290). Call 3 is the two-rank multi-GPU pytest (`gpu_tests.sh 170 every_row_on_every_rank`)."""

import json
from pathlib import Path

from trainer.bench.layouts import plot as plot_layouts

HERE = Path(__file__).parent
first = json.loads((HERE / "call1" / "layouts.json").read_text())
second = json.loads((HERE / "call2" / "layouts.json").read_text())
runs = first["layouts"] + [r for r in second["layouts"] if r["name"] not in {x["name"] for x in first["layouts"]}]
out = {**first, "layouts": runs, "session": 21, "device": "2 x NVIDIA H200",
       "note": ("Two layouts-bench calls back to back on one held machine (2 x H200): call 1 ran colocate-2 and "
                "1v1-sync, call 2 ran 1v1-sync-pixels (the limit of call 1 stopped it). No colocate-1 ran, so there "
                "are no efficiency ratios; 1v1-sync-pixels beside 1v1-sync is the comparison.")}
Path("docs/benchmarks/layouts-session21.json").write_text(json.dumps(out, indent=2) + "\n")
plot_layouts(out, Path("docs/benchmarks/layouts-session21.png"))
for r in runs:
    m = r["means"]
    print(r["name"], "samples/s", round(r["trained_samples_per_s"], 3), "step", round(r["step_wall_s"], 2),
          "encode", round(m["time/encode_s"], 3), "generate", round(m["time/generate_s"], 2), "idle%",
          r.get("learner_idle_pct"))
