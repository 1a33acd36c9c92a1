"""``python -m trainer bench``: packed vs padded teacher-forced forward+backward, measured side by side.

Builds random-weight Qwen3 models of a given size, a batch of variable-length segments drawn like stage-2
``Y_train`` lengths, and times forward+backward for (a) the padded batch and (b) the same segments packed into
rows of ``packing_length`` (block-diagonal attention, or varlen when flash-attn is present). Writes
``docs/benchmarks/packing.json`` and ``packing.png``. Ratios are from one run on one device.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from trainer.packing.packed_batch import block_causal_mask
from trainer.packing.select import select_segments
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention, varlen_available


def _model(hidden: int, layers: int, vocab: int, device: str, dtype: torch.dtype, attn: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
                      max_position_embeddings=32768, attn_implementation=attn)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).train()


def _time(fn, device: str, repeats: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def run_bench(hidden: int, layers: int, n_segments: int, packing_length: int, min_len: int, max_len: int,
              repeats: int, seed: int = 0) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n_segments)]
    vocab = 32000
    model = _model(hidden, layers, vocab, device, dtype, "sdpa")
    tokens = sum(lengths)

    def padded_step():
        width = max(lengths)
        ids = torch.randint(0, vocab, (len(lengths), width), device=device)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        out = model(input_ids=ids, attention_mask=mask).logits
        out.mean().backward()
        model.zero_grad(set_to_none=True)

    rows: list[list[int]] = []
    pending = list(lengths)
    while pending:
        chosen = select_segments(pending, packing_length)
        rows.append([pending[i] for i in chosen])
        pending = [n for i, n in enumerate(pending) if i not in set(chosen)]

    def packed_step():
        for row in rows:
            n = sum(row)
            ids = torch.randint(0, vocab, (1, n), device=device)
            pos = torch.cat([torch.arange(k) for k in row])[None].to(device)
            mask = block_causal_mask(row).to(device)
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
            out.mean().backward()
        model.zero_grad(set_to_none=True)

    def packed_varlen_step():
        impl = register_varlen_attention()
        with packed_attention(model, impl):
            for row in rows:
                n = sum(row)
                ids = torch.randint(0, vocab, (1, n), device=device)
                pos = torch.cat([torch.arange(k) for k in row])[None].to(device)
                cu = torch.tensor([0, *torch.cumsum(torch.tensor(row), 0).tolist()], dtype=torch.int32, device=device)
                out = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=max(row), max_length_k=max(row)).logits
                out.mean().backward()
        model.zero_grad(set_to_none=True)

    padded_s = _time(padded_step, device, repeats)
    packed_s = _time(packed_step, device, repeats)
    varlen_s = _time(packed_varlen_step, device, repeats) if varlen_available() else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        padded_step()
        padded_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        (packed_varlen_step if varlen_s else packed_step)()
        packed_peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        padded_peak = packed_peak = None
    return {
        "packed_varlen_s_per_step": varlen_s,
        "packed_varlen_tokens_per_s": tokens / varlen_s if varlen_s else None,
        "speedup_varlen_vs_padded": padded_s / varlen_s if varlen_s else None,
        "padded_peak_gib": padded_peak, "packed_peak_gib": packed_peak,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype), "hidden": hidden, "layers": layers, "segments": n_segments,
        "segment_len_range": [min_len, max_len], "real_tokens": tokens, "packing_length": packing_length,
        "packed_rows": len(rows), "padded_tokens": len(lengths) * max(lengths),
        "padded_s_per_step": padded_s, "packed_s_per_step": packed_s,
        "padded_tokens_per_s": tokens / padded_s, "packed_tokens_per_s": tokens / packed_s,
        "speedup_packed_vs_padded": padded_s / packed_s,
    }


def offload_bench(hidden: int, layers: int, engine_gib: float) -> dict:
    """Peak GPU memory while a colocated engine holds ``engine_gib`` (weights + KV), with and without offload,
    and the cost of moving the training state out and back (seconds)."""
    from trainer.buffering.offload import offload_for_rollout

    model = _model(hidden, layers, 32000, "cuda", torch.bfloat16, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.randint(0, 32000, (1, 256), device="cuda")).logits.mean().backward()
    opt.step()

    def decode() -> float:
        torch.cuda.reset_peak_memory_stats()
        engine = torch.empty(int(engine_gib * 2**30), dtype=torch.uint8, device="cuda")
        del engine
        return torch.cuda.max_memory_allocated() / 2**30

    without = decode()
    start = time.perf_counter()
    with offload_for_rollout(model, opt) as stats:
        moved_out = time.perf_counter() - start
        with_offload = decode()
        back_start = time.perf_counter()
    moved_back = time.perf_counter() - back_start
    return {"engine_gib": engine_gib, "params_gib": stats.moved_param_bytes / 2**30,
            "optimizer_gib": stats.moved_optimizer_bytes / 2**30, "peak_without_offload_gib": without,
            "peak_with_offload_gib": with_offload, "offload_s": moved_out, "restore_s": moved_back}


def plot(results: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['segment_len_range'][0]}-{r['segment_len_range'][1]} tok" for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.27
    ax.bar([i - w for i in x], [r["padded_tokens_per_s"] for r in results], width=w, label="padded")
    ax.bar(list(x), [r["packed_tokens_per_s"] for r in results], width=w, label="packed (sdpa + block mask)")
    if results[0]["packed_varlen_tokens_per_s"]:
        ax.bar([i + w for i in x], [r["packed_varlen_tokens_per_s"] for r in results], width=w,
               label="packed (torch varlen)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("real tokens / s (fwd+bwd)")
    ax.set_title(f"post-rollout packing on {results[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranges = [(64, 512), (128, 2048), (256, 4096)] if not args.quick else [(16, 64)]
    results = [run_bench(args.hidden, args.layers, args.segments, args.packing_length, lo, hi, args.repeats)
               for lo, hi in ranges]
    (out / "packing.json").write_text(json.dumps(results, indent=2))
    if torch.cuda.is_available():
        off = offload_bench(args.hidden, args.layers, engine_gib=8.0)
        (out / "offload.json").write_text(json.dumps(off, indent=2))
        print(f"offload: peak {off['peak_without_offload_gib']:.1f} GiB -> {off['peak_with_offload_gib']:.1f} GiB "
              f"(moved {off['params_gib'] + off['optimizer_gib']:.1f} GiB in {off['offload_s']:.2f}s, "
              f"back in {off['restore_s']:.2f}s)")
    plot(results, out / "packing.png")
    for r in results:
        print(f"{r['segment_len_range']}: padded {r['padded_tokens_per_s']:.0f} tok/s, packed(mask) "
              f"{r['packed_tokens_per_s']:.0f} tok/s x{r['speedup_packed_vs_padded']:.2f}, packed(varlen) "
              f"{r['packed_varlen_tokens_per_s'] or 0:.0f} tok/s x{r['speedup_varlen_vs_padded'] or 0:.2f}; "
              f"peak GiB padded {r['padded_peak_gib']} packed {r['packed_peak_gib']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="packed vs padded forward+backward benchmark (JSON + PNG)")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--segments", type=int, default=16)
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.set_defaults(func=run)
