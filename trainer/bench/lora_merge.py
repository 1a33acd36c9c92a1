"""The LoRA merge of a full weight sync, per ``sync.merge_precision`` (``python -m trainer bench --only lora-merge``).

What ``full_weights`` spends merging an all-linear LoRA (r=64, float32 factors as peft keeps them) into the 16-bit
decoder of a Qwen3-VL language model at a published size (``RM_BENCH_MERGE_SIZE=2b|4b|8b``, default 8b; the
vision tower and embeddings carry no adapter and are passed through, so they are left out), built on the device
(``RM_BENCH_MERGE_LAYERS``: that size's widths with fewer layers, for a CPU; ``RM_BENCH_MERGE_REPEATS``, default 7):

* ``weight_dtype``: factors rounded to bf16, one ``addmm`` per layer onto the weight (the default);
* ``float32``: the products in float32, added and rounded once (peft's arithmetic);
* ``floor``: a copy of every adapted weight (read once, written once): what any out-of-place merge moves at least.

The three run alternately in one process (``repeats`` rounds, median per variant, the device synchronized around
each call), and the two merges are compared element by element: the fraction of weights that differ and the largest
difference in rounding steps. ``--quick``: two decoder layers of a tiny shape on the CPU
(tests). Writes ``lora_merge.json`` / ``lora_merge.png`` (``_quick`` suffixed under ``--quick``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

RANK = 64
REPEATS = 7
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)


def lora_decoder(shape: dict[str, int], device: str, rank: int) -> torch.nn.Module:
    """A random bf16 Qwen3 decoder of ``shape`` (256-token vocabulary: the embeddings carry no adapter) built on
    ``device``, wrapped in an all-linear peft LoRA whose float32 factors are all non-zero and use float32's precision,
    as after training."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, tie_word_embeddings=False, **shape)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                             init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(1 + 0.01 * torch.randn_like(p)).mul_(0.01 if "lora_B" in name else 1.0)
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _step(y: torch.Tensor) -> torch.Tensor:
    """bf16's rounding step at ``|y|`` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(y), torch.frexp(y).exponent - 8)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> dict[str, float]:
    """How ``a`` and ``b`` differ over ``keys``: the fraction of elements that differ; the fraction that differ by
    more than one rounding step of the larger of the two values (near a cancellation, W + delta ~ 0, a small
    absolute difference is many steps of the small result); the largest difference in steps of the tensor's rms."""
    differ = beyond = total = 0
    worst = 0.0
    for k in keys:
        x, y = a[k].float(), b[k].float()
        d = (x - y).abs()
        differ += int((d > 0).sum())
        beyond += int((d > _step(torch.maximum(x.abs(), y.abs()))).sum())
        total += y.numel()
        rms = y.pow(2).mean().sqrt().reshape(1)
        worst = max(worst, float(d.max() / _step(rms)[0])) if rms.item() > 0 else worst
    return {"fraction_differing": differ / total if total else 0.0,
            "fraction_beyond_one_step": beyond / total if total else 0.0, "max_difference_rms_steps": worst}


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    from trainer.bench.scale import QWEN3_VL_TEXT
    from trainer.sync.weights import MERGE_PRECISIONS, full_weights

    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    if quick:
        size, shape, repeats = "tiny", QUICK_SHAPE, 3
    else:
        size = os.environ.get("RM_BENCH_MERGE_SIZE", "8b")
        if size not in QWEN3_VL_TEXT:
            raise SystemExit(f"RM_BENCH_MERGE_SIZE={size!r}: one of {sorted(QWEN3_VL_TEXT)}")
        shape, repeats = dict(QWEN3_VL_TEXT[size]), int(os.environ.get("RM_BENCH_MERGE_REPEATS", str(REPEATS)))
        if os.environ.get("RM_BENCH_MERGE_LAYERS"):  # the size's widths, fewer layers (a CPU run)
            shape["num_hidden_layers"] = int(os.environ["RM_BENCH_MERGE_LAYERS"])
    t0 = time.perf_counter()
    model = lora_decoder(shape, device, RANK)
    build_s = time.perf_counter() - t0
    from peft.tuners.lora import LoraLayer

    bases = {n.removeprefix("base_model.model.") + ".weight": m.get_base_layer().weight
             for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    adapted = list(bases)
    adapted_bytes = sum(w.numel() * w.element_size() for w in bases.values())
    variants = {p: (lambda p=p: full_weights(model, merge_precision=p)) for p in MERGE_PRECISIONS}
    variants["floor"] = lambda: {k: w.clone() for k, w in bases.items()}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(repeats + 1):  # the first round warms up (allocator, kernels, the cached layout)
        for name, fn in variants.items():
            spent, result = _timed(fn, device)
            if i:
                seconds[name].append(spent)
            if name in MERGE_PRECISIONS and i == repeats:
                merged[name] = {k: result[k] for k in adapted}
            del result
    med = {v: statistics.median(s) for v, s in seconds.items()}
    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
        "size": size, "layers": shape["num_hidden_layers"], "shape": shape, "lora_rank": RANK,
        "adapted_layers": len(adapted),
        "adapted_gb": adapted_bytes / 1e9, "build_s": build_s, "repeats": repeats, "quick": quick,
        "seconds": seconds, "median_ms": {v: s * 1e3 for v, s in med.items()},
        "float32_over_weight_dtype": med["float32"] / med["weight_dtype"],
        "weight_dtype_over_floor": med["weight_dtype"] / med["floor"],
        "agreement": compare(merged["weight_dtype"], merged["float32"], adapted),
    }
    print(f"bench lora-merge ({rec['device']}, {size} x {rec['layers']} layers, {len(adapted)} adapted, {rec['adapted_gb']:.1f} GB adapted): "
          + ", ".join(f"{v} {ms:.1f} ms" for v, ms in rec["median_ms"].items())
          + f"; float32/weight_dtype {rec['float32_over_weight_dtype']:.2f}x; differing "
          f"{rec['agreement']['fraction_differing']:.4f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    name = "lora_merge_quick" if quick else "lora_merge"
    (out / f"{name}.json").write_text(json.dumps(rec, indent=2))
    plot(rec, out / f"{name}.png")
    return rec


def plot(rec: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(rec["median_ms"])
    ax.bar(names, [rec["median_ms"][n] for n in names], color=["tab:green", "tab:orange", "tab:gray"][:len(names)])
    for i, n in enumerate(names):
        ax.text(i, rec["median_ms"][n], f"{rec['median_ms'][n]:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per merge (median)")
    ax.set_title(f"LoRA r={rec['lora_rank']} merge of a Qwen3-VL {rec['size']} decoder, {rec['layers']} layers "
                 f"({rec['adapted_gb']:.1f} GB adapted)\n{rec['device']}, torch {rec['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
