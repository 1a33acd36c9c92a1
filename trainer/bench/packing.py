"""Packing benchmark: stage-2 teacher-forced forward+backward, padded vs packed, side by side.

A random-weight Qwen3-0.6B-shaped model (bf16 on CUDA, gradient checkpointing) trains on stage-2-shaped
segments: lengths uniform in [min_len, max_len], micro-batch ``micro_batch``; each segment is a prompt (image +
instruction, no labels) followed by a rollout prefix whose coord slots are supervised and an appended tail with CE
labels. Every variant runs the trainer's own ``forward_loss`` on the same micro-batches:

* ``padded/full``: one target per row, HF padding mask, full ``[B, T, V]`` logits (the un-packed baseline);
* ``padded/supervised``: the same rows, LM head only at supervised positions;
* ``packed-varlen/full`` and ``packed-varlen/supervised``: all segments of a micro-batch in one row, PyTorch varlen
  attention (``rm_varlen``), restarting position ids;
* ``packed-varlen/supervised+coord-only``: ``coord_gate_weight: 0``, coord rows over the 1000 coord columns only;
* ``packed-mask/supervised``: the dense block-diagonal mask fallback (sdpa);
* ``…/supervised+chunked``: supervised rows projected and reduced ``LOGIT_CHUNK_ROWS`` at a time
  (``loss.logit_chunk_rows``, the default; the plain ``supervised`` variants hold every row's
  logits), on the widest packed layout: the peak-memory difference is the point.

Real tokens/s, ratios against ``padded/full`` and MFU (model FLOPs of a full causal-LM forward+backward over the
real tokens, recompute not counted, over ``peak_tflops``: by default the card's own dense BF16 peak,
``models.peak_bf16_tflops``) go to ``<out>/packing.json`` + ``packing.png`` (``python -m trainer bench packing``).
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import torch

from trainer.bench.models import QWEN3_0_6B, TINY, peak_bf16_tflops, random_qwen3
from trainer.losses.objective import LossWeights
from trainer.matching.targets import IGNORE_INDEX, TrainTarget
from trainer.modeling.compile import compile_decoder_layers, decoder_layers
from trainer.packing.batching import pad_targets
from trainer.packing.packed_batch import pack_targets
from trainer.packing.varlen_attention import (
    packed_attention,
    register_varlen_attention,
    unguarded_segment_counts,
    varlen_available,
)
from trainer.sft.forward import forward_loss

__all__ = ["QWEN3_0_6B", "TINY", "model_flops", "plot", "run_bench", "stage2_segment"]

OBJECT_TOKENS, COORDS_PER_OBJECT = 13, 4
LOGIT_CHUNK_ROWS = 1024


def stage2_segment(rng: random.Random, sample_id: str, length: int, vocab: int, coord_ids: list[int],
                   tail_fraction: float = 0.25) -> TrainTarget:
    """A target shaped like stage 2's: prompt (30-60 %, no labels), rollout prefix (coord slots only), tail (CE)."""
    prompt = max(1, int(length * rng.uniform(0.3, 0.6)))
    response = length - prompt
    tail = int(response * tail_fraction)
    ids = [rng.randrange(vocab - len(coord_ids)) for _ in range(length)]
    labels = [IGNORE_INDEX] * length
    coord_positions, coord_targets = [], []
    for i in range(response):
        pos = prompt + i
        if i % OBJECT_TOKENS >= OBJECT_TOKENS - COORDS_PER_OBJECT - 1 and i % OBJECT_TOKENS < OBJECT_TOKENS - 1:
            b = rng.randrange(len(coord_ids))
            ids[pos] = coord_ids[b]
            coord_positions.append(pos)
            coord_targets.append(float(b))
        elif i >= response - tail:
            labels[pos] = ids[pos]
    return TrainTarget(sample_id, ids, labels, coord_positions, coord_targets, prompt, response - tail, tail)


def model_flops(shape: dict, lengths: list[int]) -> float:
    """Forward+backward FLOPs of a causal LM over segments (6·N·tokens + causal attention), no recompute."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    d_q = shape["num_attention_heads"] * shape["head_dim"]
    d_kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * d_q * 2 + h * d_kv * 2 + 3 * h * shape["intermediate_size"]
    n = layers * per_layer + h * shape["vocab_size"]
    return sum(6 * n * L + 6 * layers * L * L * d_q for L in lengths)


def _to(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _timed(step, device: str, repeats: int) -> tuple[float, float, float | None]:
    """(first, untimed-warm-up pass seconds — compilation included; mean seconds of ``repeats`` passes; peak GiB)."""
    first = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - first
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return first, (time.perf_counter() - start) / repeats, peak


def run_bench(shape: dict, micro_batch: int = 4, segments: int = 32, wide: int = 16, min_len: int = 300,
              max_len: int = 2000, repeats: int = 3, gradient_checkpointing: bool = True, seed: int = 0,
              peak_tflops: float | None = None, compile_layers: bool = False) -> dict:
    """Every variant trains the same ``segments`` targets once per pass (forward+backward, no optimizer step).

    ``micro_batch`` segments per forward is the configuration under test; ``wide`` segments per forward is the
    same samples per optimizer step in fewer forwards (e.g. micro-batch 4 × accumulation 4 vs micro-batch 16).
    ``compile_layers`` adds the main variants again with ``training.compile_decoder_layers`` (run last: compiling
    is in place).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if peak_tflops is None and device == "cuda":
        peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name())
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rng = random.Random(seed)
    vocab = shape["vocab_size"]
    coord_list = list(range(vocab - 1000, vocab)) if vocab > 2000 else list(range(vocab - 256, vocab))
    coord_ids = torch.tensor(coord_list, device=device)
    targets = [stage2_segment(rng, f"s{i}", rng.randint(min_len, max_len), vocab, coord_list) for i in range(segments)]
    lengths = [t.length for t in targets]
    supervised = sum(sum(lab != IGNORE_INDEX for lab in t.labels) + len(t.coord_positions) for t in targets)
    model = random_qwen3(shape, device=device, dtype=dtype, seed=seed, train=True,
                         gradient_checkpointing=gradient_checkpointing)
    impl = register_varlen_attention() if varlen_available() else None

    def groups(k: int) -> list[list[TrainTarget]]:
        return [targets[i:i + k] for i in range(0, len(targets), k)]

    layouts = {}
    for k in (micro_batch, wide):
        layouts[("padded", k)] = [_to(pad_targets(g, 0), device) for g in groups(k)]
        layouts[("packed-mask", k)] = [_to(pack_targets(g, "sdpa"), device) for g in groups(k)]
        if impl:
            layouts[("packed-varlen", k)] = [_to(pack_targets(g, impl), device) for g in groups(k)]
    default_w, no_gate = LossWeights(), LossWeights(coord_gate=0.0)
    variants = [("padded", micro_batch, "full", default_w), ("padded", micro_batch, "supervised", default_w),
                ("packed-varlen", micro_batch, "full", default_w), ("packed-varlen", micro_batch, "supervised", default_w),
                ("packed-varlen", micro_batch, "supervised+coord-only", no_gate),
                ("packed-mask", micro_batch, "supervised", default_w),
                ("padded", wide, "full", default_w), ("padded", wide, "supervised", default_w),
                ("packed-varlen", wide, "supervised", default_w),
                ("packed-varlen", wide, "supervised+chunked", default_w)]
    if not impl:
        variants += [("packed-mask", wide, "supervised", default_w), ("packed-mask", wide, "supervised+chunked", default_w)]
    variants = [(*v, False) for v in variants]
    if compile_layers:
        packed = "packed-varlen" if impl else "packed-mask"
        variants += [("padded", micro_batch, "full", default_w, True), (packed, micro_batch, "supervised", default_w, True),
                     ("padded", wide, "supervised", default_w, True), (packed, wide, "supervised", default_w, True)]
    flops = model_flops(shape, lengths)
    results = []
    for layout, k, logits, w, compiled in variants:
        if (layout, k) not in layouts:
            continue
        if compiled and not any(layer._compiled_call_impl is not None for layer in decoder_layers(model)):
            compile_decoder_layers(model)
        ctx = (lambda: packed_attention(model, impl)) if layout == "packed-varlen" else contextlib.nullcontext

        def step(rows=layouts[(layout, k)], logits=logits, w=w, ctx=ctx, varlen=layout == "packed-varlen"):
            for batch in rows:
                if varlen:  # our op: its segment count unbacked, as the trainer does
                    unguarded_segment_counts(batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k"))
                with ctx():
                    loss, _, _ = forward_loss(model, batch, coord_ids, w, supervised_logits=logits != "full",
                                              logit_chunk_rows=LOGIT_CHUNK_ROWS if "chunked" in logits else None)
                    loss.backward()
            model.zero_grad(set_to_none=True)

        name = f"{layout}/{logits} ×{k}" + (" compiled" if compiled else "")
        try:
            compile_s, seconds, peak = _timed(step, device, repeats)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            results.append({"variant": name, "layout": layout, "segments_per_forward": k, "logits": logits,
                            "compiled": compiled, "error": "out of memory"})
            continue
        print(f"{name}: {sum(lengths) / seconds:.0f} real tok/s, peak {peak} GiB", flush=True)
        results.append({"variant": name, "layout": layout, "segments_per_forward": k, "logits": logits,
                        "compiled": compiled, "first_pass_s": compile_s,
                        "forwards_per_pass": len(layouts[(layout, k)]), "s_per_pass": seconds,
                        "real_tokens_per_s": sum(lengths) / seconds,
                        "mfu": flops / seconds / (peak_tflops * 1e12) if device == "cuda" and peak_tflops else None,
                        "peak_gib": peak})
    base = results[0]["real_tokens_per_s"]
    for r in results:
        if "real_tokens_per_s" in r:
            r["speedup_vs_padded_full"] = r["real_tokens_per_s"] / base
    padded_tokens = {k: sum(len(g) * max(t.length for t in g) for g in groups(k)) for k in (micro_batch, wide)}
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
        "torch": torch.__version__, "model_shape": shape, "gradient_checkpointing": gradient_checkpointing,
        "micro_batch": micro_batch, "wide_segments_per_forward": wide, "segments_per_pass": segments,
        "segment_len_range": [min_len, max_len], "real_tokens_per_pass": sum(lengths),
        "padded_tokens_per_pass": {str(k): v for k, v in padded_tokens.items()},
        "supervised_positions_fraction": supervised / sum(lengths), "model_tflops_per_pass": flops / 1e12,
        "peak_tflops": peak_tflops, "repeats": repeats, "results": results,
    }


def plot(result: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "real_tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.barh([r["variant"] for r in rows][::-1], [r["real_tokens_per_s"] for r in rows][::-1],
                   color=["#888" if r["layout"] == "padded" else "#2a7" for r in rows][::-1])
    for bar, r in zip(bars, rows[::-1]):
        mfu = f", MFU {100 * r['mfu']:.0f}%" if r["mfu"] is not None else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['speedup_vs_padded_full']:.2f}×{mfu}",
                va="center", fontsize=8)
    ax.set_xlabel("real tokens / s (forward + backward)")
    lo, hi = result["segment_len_range"]
    ax.set_title(f"stage-2 teacher-forced fwd+bwd, {result['device']}: lengths {lo}-{hi}; ×k = segments per "
                 "forward", fontsize=9)
    ax.set_xlim(0, max(r["real_tokens_per_s"] for r in rows) * 1.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
