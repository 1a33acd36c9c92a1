"""Session 16 (``gc_colocate_vs_hf.txt``). CPU: stage 2 on a tiny text model, vLLM colocate (in-process engine) vs the HF backend, same data and seeds;
mean gc/pause_s, gc/gen2_collections, time/target_s, time/build_target_s of steps 2.. ."""
import json
import statistics
import sys
from pathlib import Path

from trainer.config.schema import validate_config
from trainer.rollout import vllm_colocate
from trainer.sft.run import run_training
from trainer.telemetry import read_jsonl

real_init = vllm_colocate.VllmColocateEngine.__init__
def keep(self, *a, **k):
    k["engine_kwargs"] = {**(k.get("engine_kwargs") or {}), "enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}
    real_init(self, *a, **k)
vllm_colocate.VllmColocateEngine.__init__ = keep

def cfg(root, backend):
    rm = {"rollout_backend": backend, "rollout_generate_batch_size": 16, "decoding": {"max_new_tokens": 64},
          "matching": {"mask_resolution": 64}}
    if backend == "vllm":
        rm["vllm"] = {"mode": "colocate", "max_model_len": 1024, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    return {"model": {"tiny": "text"},
            "data": {"synthetic": {"num_samples": 96, "seed": 3, "min_objects": 20, "max_objects": 40, "image_size": 64}},
            "training": {"output_dir": str(root / backend), "max_steps": 5, "per_device_train_batch_size": 16,
                         "learning_rate": 1e-4, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                         "report_to": ["jsonl"]},
            "custom": {"extra": {"rollout_matching": rm}}}

root = Path(sys.argv[1])
for backend in sys.argv[2:]:
    s = run_training(validate_config(cfg(root, backend)))
    rows = [r for r in read_jsonl(s.metrics_path) if r.get("phase") == "stage2" and "loss" in r][1:]
    m = {k: round(statistics.mean(r.get(k, 0.0) for r in rows), 4) for k in
         ("gc/pause_s", "gc/collections", "gc/gen2_collections", "time/target_s", "time/build_target_s", "time/encode_s", "time/generate_s")}
    print(backend, json.dumps(m), flush=True)
