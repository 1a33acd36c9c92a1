# Peak host memory (VmHWM of a fresh process) and time of the stage-2 loss's forward + backward from the LM head's
# input: all supervised rows at once (objective_from_rows) vs loss.logit_chunk_rows chunks (chunked_objective).
# Shapes of the 16k-token Qwen3-VL-2B pack of the scale bench, rows halved to fit this 24 GiB machine: hidden 2048,
# vocabulary 151,936 (bf16 head and hidden), 4,200 CE rows + 670 coord slots (the pack had 8,410 + 1,344).
# Usage: python logit_chunks.py            (runs every mode, each in its own process)
import json, subprocess, sys, time
import torch

MODES = ["all-rows", "chunk-4096", "chunk-1024", "chunk-256"]


def peak_rss_gib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM")


def one(mode: str) -> dict:
    from trainer.losses.chunked_objective import chunked_objective
    from trainer.losses.objective import LossWeights, objective_from_rows
    from trainer.losses.supervised_logits import supervised_rows

    torch.manual_seed(0)
    h, v, n_ce, n_coord, k = 2048, 151_936, 4_200, 670, 1000
    t = n_ce + n_coord + 1
    hidden = (torch.randn(1, t, h) * 0.5).bfloat16().requires_grad_()
    head = torch.nn.Linear(h, v, bias=False).bfloat16()
    pos = torch.randperm(t - 1)[:n_ce + n_coord] + 1
    batch = {"ce_index": torch.stack([torch.zeros(n_ce, dtype=torch.long), pos[:n_ce]], 1),
             "ce_labels": torch.randint(0, v, (n_ce,)),
             "coord_index": torch.stack([torch.zeros(n_coord, dtype=torch.long), pos[n_ce:]], 1),
             "coord_targets": torch.rand(n_coord) * (k - 1)}
    coord_ids = torch.arange(v - k, v)
    w = LossWeights()
    base = peak_rss_gib()
    t0 = time.perf_counter()
    if mode == "all-rows":
        loss, _ = objective_from_rows(supervised_rows(hidden, head, batch, coord_ids), batch, coord_ids, w)
    else:
        loss, _ = chunked_objective(hidden, head, batch, coord_ids, w, chunk_rows=int(mode.split("-")[1]))
    loss.backward()
    spent = time.perf_counter() - t0
    return {"mode": mode, "loss": float(loss.detach()), "seconds": spent, "peak_rss_gib": peak_rss_gib(),
            "peak_above_inputs_gib": peak_rss_gib() - base,
            "grad_hidden_norm": float(hidden.grad.float().norm()), "grad_head_norm": float(head.weight.grad.float().norm())}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one(sys.argv[1])))
    else:
        rows = [json.loads(subprocess.run([sys.executable, __file__, m], capture_output=True, text=True, check=True)
                           .stdout.strip().splitlines()[-1]) for m in MODES]
        for r in rows:
            print(f"{r['mode']:11s} peak above the inputs {r['peak_above_inputs_gib']:6.2f} GiB  "
                  f"{r['seconds']:6.1f} s  loss {r['loss']:.6f}  |grad hidden| {r['grad_hidden_norm']:.6f}  "
                  f"|grad head| {r['grad_head_norm']:.6f}")
