"""Session 24: the packed attention alone, ``op`` (trainer.packing.varlen_kernel: aten flash, K/V heads as they are)
against ``api`` (torch's varlen_attn with K/V repeated to the query heads, the transposes made contiguous, as
``rm_varlen_api`` does), forward + backward of one packed row, CUDA events, median of 20 after 5 warm-ups.
Usage: python varlen_micro.py > varlen_micro.json"""
import json
import statistics

import torch
from torch.nn.attention.varlen import varlen_attn

from trainer.packing.varlen_attention import _causal_kwargs
from trainer.packing.varlen_kernel import varlen_attention


def row(lengths, hq, hkv, d=128):
    n = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32, device="cuda")
    # HF's layout: [1, H, L, D] views of [L, H, D] projections
    q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for h in (hq, hkv, hkv))
    return q, k, v, cu, max(lengths)


def op(q, k, v, cu, m, bound):
    out, _ = varlen_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, bound, None)
    return out


def api(q, k, v, cu, m, bound):
    q_, k_, v_ = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    rep = q_.shape[1] // k_.shape[1]
    return varlen_attn(q_, k_.repeat_interleave(rep, 1), v_.repeat_interleave(rep, 1), cu, cu, m, m,
                       **_causal_kwargs(varlen_attn))


def time_it(fn, args):
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
        for t in args[:3]:
            t.grad = None
    return statistics.median(times)


records = []
shapes = {"2b": (16, 8), "4b": (32, 8), "8b": (32, 8)}
for size, (hq, hkv) in shapes.items():
    for name, lengths in (("16k", [3100, 2900, 3300, 2700, 3000, 1384]), ("4k", [2600, 1496])):
        args = row(lengths, hq, hkv)
        n = sum(lengths)
        rec = {"size": size, "row": name, "tokens": n, "heads": [hq, hkv],
               "api_ms": time_it(api, (*args, None)), "op_exact_ms": time_it(op, (*args, args[4])),
               "op_row_bound_ms": time_it(op, (*args, n))}
        rec["api_over_op_exact"] = rec["api_ms"] / rec["op_exact_ms"]
        rec["row_bound_over_exact"] = rec["op_row_bound_ms"] / rec["op_exact_ms"]
        print(json.dumps(rec), flush=True)
        records.append(rec)
        if size == "8b":
            break
print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}))
