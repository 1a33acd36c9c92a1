"""Host-side work of a weight sync per tensor count (``python -m trainer bench --only sync-host``; CPU).

What a sync costs before any byte moves: ``full_weights`` (the cached layout's validity check, the LoRA merge terms,
the batched merge) and ``check_update`` (names, shapes, dtypes, finite values). The tensors are Qwen3 decoder layers
of tiny widths (64 hidden, 128 intermediate), so the figure is the per-tensor Python and dispatch overhead that a
real model pays on top of its copies: an 8B Qwen3-VL syncs ~750 tensors, 252 of them LoRA-merged with all-linear
r=64. Variants per layer count: the plain model and the same model with an all-linear LoRA (r=8) merged.

Per point: tensors, ``full_weights`` first call (builds the cached layout) and median of ``repeats`` later calls,
``check_update`` median, and microseconds per tensor. On a CPU ``check_update``'s finite check reduces the data on
the CPU (``torch._foreach_norm`` falls back to one kernel per tensor there), so its figure is data as much as
overhead; on a GPU that check is one fused kernel. ``--quick``: 4 and 8 layers, 3 repeats (tests). Writes
``sync_host.json`` and ``sync_host.png``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LAYERS = (10, 20, 40, 80)
REPEATS = 15


def tiny_qwen3(layers: int, lora: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=32))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))


def measure(model: torch.nn.Module, repeats: int) -> dict[str, Any]:
    from trainer.sync.update_check import check_update, spec_from_state_dict
    from trainer.sync.weights import full_weights

    t0 = time.perf_counter()
    tensors = full_weights(model)
    first = time.perf_counter() - t0
    spec = spec_from_state_dict(tensors)
    syncs, checks = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tensors = full_weights(model)
        syncs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_update(tensors, spec)
        checks.append(time.perf_counter() - t0)
    n = len(tensors)
    sync, check = statistics.median(syncs), statistics.median(checks)
    return {"tensors": n, "full_weights_first_ms": first * 1e3, "full_weights_ms": sync * 1e3,
            "check_update_ms": check * 1e3, "full_weights_us_per_tensor": sync / n * 1e6,
            "check_update_us_per_tensor": check / n * 1e6}


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    layers, repeats = ((4, 8), 3) if quick else (LAYERS, REPEATS)
    result: dict[str, Any] = {
        "machine": {"cpu_cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "repeats": repeats, "quick": quick, "results": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, so the figure is per-tensor overhead, not how many cores share a kernel
    try:
        for n_layers in layers:
            for lora in (False, True):
                result["results"].append({"layers": n_layers, "variant": "lora-merged" if lora else "plain",
                                          **measure(tiny_qwen3(n_layers, lora), repeats)})
    finally:
        torch.set_num_threads(threads)
    for rec in result["results"]:
        print(f"bench sync-host: {rec['variant']:12s} {rec['tensors']:5d} tensors  full_weights "
              f"{rec['full_weights_ms']:7.2f} ms ({rec['full_weights_us_per_tensor']:5.1f} us/tensor, first "
              f"{rec['full_weights_first_ms']:.0f} ms)  check_update {rec['check_update_ms']:6.2f} ms", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    name = "sync_host_quick" if quick else "sync_host"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, marker in (("plain", "o"), ("lora-merged", "s")):
        rows = [r for r in result["results"] if r["variant"] == variant]
        ax.plot([r["tensors"] for r in rows], [r["full_weights_ms"] for r in rows], marker=marker,
                label=f"full_weights, {variant}")
        ax.plot([r["tensors"] for r in rows], [r["check_update_ms"] for r in rows], marker=marker, linestyle="--",
                label=f"check_update, {variant}")
    ax.set_xlabel("tensors in the update")
    ax.set_ylabel("ms per sync (median)")
    ax.set_ylim(bottom=0)
    m = result["machine"]
    ax.set_title(f"host-side work of a weight sync (tiny widths: overhead per tensor)\n"
                 f"{m['cpu_cores']} cores, one torch thread, torch {m['torch']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
