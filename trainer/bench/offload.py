"""Offload benchmark (CUDA only): peak GPU memory while a colocated rollout engine holds its share, with and without
moving the training model + optimizer state to CPU (``trainer.memory.offload``), and what the moves cost."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainer.bench.models import QWEN3_0_6B, random_qwen3


def offload_bench(hidden: int, layers: int, engine_gib: float) -> dict:
    """Peak GPU memory while a colocated engine holds ``engine_gib`` (weights + KV), with and without offload,
    and the cost of moving the training state out and back (seconds)."""
    from trainer.memory.offload import offload_for_rollout

    shape = dict(QWEN3_0_6B, vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3,
                 num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512))
    model = random_qwen3(shape, device="cuda", dtype=torch.bfloat16, train=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.randint(0, 32000, (1, 256), device="cuda")).logits.mean().backward()
    opt.step()

    def decode() -> float:
        torch.cuda.reset_peak_memory_stats()
        engine = torch.empty(int(engine_gib * 2**30), dtype=torch.uint8, device="cuda")
        del engine
        return torch.cuda.max_memory_allocated() / 2**30

    def cycle() -> tuple[float, float, float, Any]:
        start = time.perf_counter()
        with offload_for_rollout(model, opt) as stats:
            moved_out = time.perf_counter() - start
            peak = decode()
            back_start = time.perf_counter()
        return moved_out, time.perf_counter() - back_start, peak, stats

    without = decode()
    moved_out, moved_back, with_offload, stats = cycle()
    again = cycle()
    return {"engine_gib": engine_gib, "params_gib": stats.moved_param_bytes / 2**30,
            "optimizer_gib": stats.moved_optimizer_bytes / 2**30, "peak_without_offload_gib": without,
            "peak_with_offload_gib": with_offload, "offload_s": moved_out, "restore_s": moved_back,
            "second_offload_s": again[0], "second_restore_s": again[1], "second_peak_gib": again[2]}
