"""What one full ``gc.collect()`` costs on a learner's heap, before and after ``gc.freeze()`` (vLLM's sleep-mode wake
runs one per step; ``trainer.sft.run.freeze_setup_objects`` freezes the setup objects). The heap: this process after
importing what a colocate learner imports (torch, transformers, vLLM, the trainer) and building the stage-2 pieces of
a tiny Qwen3-VL run (model, tokenizer, data index). CPU only; run: ``python gc_freeze_side_by_side.py``."""

import gc
import statistics
import tempfile
import time
from pathlib import Path


def collect_ms(n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    from trainer.config.schema import validate_config
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model
    from trainer.modeling.loading import load_model

    root = Path(tempfile.mkdtemp())
    model_dir = save_tiny_model(root / "tiny", "vl", seed=0)
    data = generate(root / "data", 64, seed=0, min_objects=1, max_objects=3)
    cfg = validate_config({"model": {"path": str(model_dir)}, "data": {"train_jsonl": str(data)},
                           "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}})
    loaded = load_model(cfg.model, root / "out")  # noqa: F841 - part of the heap
    print(f"objects tracked by gc: {len(gc.get_objects()):,}")
    before = collect_ms()
    gc.freeze()
    after = collect_ms()
    print(f"gc.collect() median of 7: {before:.1f} ms before gc.freeze(), {after:.2f} ms after "
          f"({gc.get_freeze_count():,} objects frozen)")


if __name__ == "__main__":
    main()
