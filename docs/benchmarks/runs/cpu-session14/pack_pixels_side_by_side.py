"""Packing one 16k row of stage-2 targets at the 2B layouts bench's shape (5 segments of ~2.6k tokens, each with a
1024² image: 4096 patches x 1536 values, 1024 image tokens), float32 pixel values against bf16 ones (what
``PromptEncoder(pixel_dtype=...)`` keeps for a bf16 model). The model is Qwen3-VL-2B's config on the meta device
(mRoPE needs only the config). Median of 5 after one warm-up, one process. Run: ``python pack_pixels_side_by_side.py``."""

import random
import statistics
import time

import torch
from transformers import Qwen3VLModel

from trainer.bench.scale import vl_config
from trainer.matching.targets import TrainTarget
from trainer.packing.batching import multimodal_inputs
from trainer.packing.packed_batch import pack_targets


def targets(cfg, dtype: torch.dtype, n: int = 5) -> list[TrainTarget]:
    random.seed(0)
    image = cfg.image_token_id
    out = []
    for i in range(n):
        answer = random.randint(1000, 2000)
        prompt = [1] * 20 + [cfg.vision_start_token_id] + [image] * 1024 + [cfg.vision_end_token_id] + [2] * 40
        ids = prompt + [random.randint(100, 5000) for _ in range(answer)]
        coords = [len(prompt) + k for k in range(0, answer, 13)]
        out.append(TrainTarget(f"s{i}", ids, [-100] * len(prompt) + ids[len(prompt):], coords, [0.5] * len(coords),
                               len(prompt), answer // 2, answer // 2,
                               mm_inputs={"pixel_values": torch.randn(4096, 1536).to(dtype),
                                          "image_grid_thw": torch.tensor([[1, 64, 64]])}))
    return out


def median_s(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    cfg = vl_config("2b")
    with torch.device("meta"):
        model = Qwen3VLModel(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        ts = targets(cfg, dtype)
        mb = sum(t.mm_inputs["pixel_values"].numel() * t.mm_inputs["pixel_values"].element_size() for t in ts) / 2**20
        cat = median_s(lambda: multimodal_inputs(ts))
        pack = median_s(lambda: pack_targets(ts, "rm_varlen", model, cfg.image_token_id))
        print(f"{str(dtype):15s} pixels {mb:6.0f} MiB per row: concatenation {cat * 1e3:6.1f} ms, "
              f"pack_targets {pack * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
