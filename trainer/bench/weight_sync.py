"""NCCL weight-sync benchmark (pure functions, no config): learner → rollout server over ``NcclTransport`` with the
pure-torch backend (``sync.nccl_backend: torch``: ``StoreGroup`` + ``TorchStatelessCommunicator``, no vLLM).

On two GPUs: the learner (this process) holds a random Qwen3-0.6B-shaped model (bf16) on ``cuda:0``; a real rollout
server (``python -m trainer serve --engine hf``, a same-shaped checkpoint of other random weights) runs on the
second GPU (``CUDA_VISIBLE_DEVICES=1``). Measured:

(a) device-to-device baselines: a torch copy of a 1 GiB bf16 tensor ``cuda:0 → cuda:1`` in this process, and an
    NCCL broadcast of one 1 GiB tensor to a peer process on the second GPU through the same communicator class;
(b) full weight syncs (``NcclTransport.push_full``: HTTP per bucket + broadcast + barrier, then
    ``/process_weights_after_loading/`` which waits until the server has applied the weights) per bucket size:
    the first push (NCCL communicator set-up included) and ``repeats`` timed pushes, seconds and GB/s
    (GB = 1e9 bytes of flattened buckets sent);
(c) after each bucket size's last push the server's per-tensor checksums (``/rm/weights_checksum/``) must equal the
    learner's (bit-exact).

Without two GPUs it runs as a CPU dry run (gloo, tiny shape) to check the plumbing. ``run(out_dir)`` writes
``weight_sync.json`` and prints a summary. GPU run::

    python -m trainer bench --only weight-sync   # or: from trainer.bench.weight_sync import run
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.bench.models import QWEN3_0_6B, TINY, random_qwen3, sync
from trainer.launch.ports import listen_port as _free_port  # below the ephemeral range

GB = 1e9




def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def save_server_model(out: Path, shape: dict[str, int], device: str, dtype: torch.dtype) -> Path:
    """A model directory the hf server engine loads: random weights (seed 0) and the embedded tokenizer."""
    from trainer.modeling.fixtures import tiny_tokenizer

    model = random_qwen3(shape, device=device, dtype=dtype, seed=0, max_position_embeddings=4096, eos_token_id=1)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    del model
    return out


def copy_baseline(nbytes: int, src: torch.device, dst: torch.device, iters: int = 5) -> dict[str, Any]:
    """A plain torch copy of one ``nbytes`` bf16 tensor from ``src`` to ``dst`` (mean of ``iters`` after 2 warm-ups)."""
    a = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=src)
    b = torch.empty_like(a, device=dst)
    for _ in range(2):
        b.copy_(a)
    sync(src)
    sync(dst)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(src)
        sync(dst)
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(a[:1024].to(dst), b[:1024]))
    del a, b
    mean = sum(times) / len(times)
    return {"bytes": nbytes, "iters": iters, "seconds_mean": mean, "seconds_min": min(times),
            "GBps": nbytes / mean / GB, "GBps_best": nbytes / min(times) / GB, "equal": ok}


def broadcast_peer(host: str, port: int, nbytes: int, iters: int, device: str) -> None:
    """The receiving rank (0) of ``broadcast_baseline`` (run in a subprocess)."""
    from trainer.sync.nccl import join_group

    comm = join_group("torch", host, port, 0, 2, torch.device(device), store_timeout=120)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(iters):
        comm.broadcast(buf, src=1)
        sync(buf.device)
        comm.group.barrier()
    comm.group.broadcast_obj(int(buf[:4096].to(torch.int64).sum()), src=0)


def broadcast_baseline(nbytes: int, device: torch.device, peer_env: dict[str, str], peer_device: str,
                       iters: int = 5, warmup: int = 2) -> dict[str, Any]:
    """One ``nbytes`` tensor broadcast from this process to a peer process (``TorchStatelessCommunicator``)."""
    from trainer.sync.nccl import join_group

    port = _free_port()
    code = (f"from trainer.bench.weight_sync import broadcast_peer; "
            f"broadcast_peer('127.0.0.1', {port}, {nbytes}, {iters + warmup}, {peer_device!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], env=peer_env)
    try:
        t_setup = time.perf_counter()
        comm = join_group("torch", "127.0.0.1", port, 1, 2, device, store_timeout=120)
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        times = []
        for i in range(iters + warmup):
            t0 = time.perf_counter()
            comm.broadcast(buf, src=1)
            sync(device)
            dt = time.perf_counter() - t0
            comm.group.barrier()
            if i == 0:
                first = time.perf_counter() - t_setup
            if i >= warmup:
                times.append(dt)
        echoed = comm.group.broadcast_obj(None, src=0)
        ok = echoed == int(buf[:4096].to(torch.int64).sum())
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    mean = sum(times) / len(times)
    return {"bytes": nbytes, "iters": iters, "first_incl_setup_s": first, "seconds_mean": mean,
            "seconds_min": min(times), "GBps": nbytes / mean / GB, "GBps_best": nbytes / min(times) / GB,
            "received_ok": ok}


@contextlib.contextmanager
def hf_server(model_dir: Path, env: dict[str, str], device: str | None, dtype: str, timeout_s: float = 240.0):
    from trainer.launch.health import serve_subprocess

    args = ["--engine", "hf", "--model", str(model_dir), "--dtype", dtype, *(["--device", device] if device else [])]
    with serve_subprocess(*args, env=env, timeout_s=timeout_s, interval_s=0.3) as (url, _, took):
        yield url, took


def _verify(url: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    import httpx

    from trainer.sync.weights import tensor_checksums

    want = tensor_checksums(tensors)
    got = httpx.get(url + "/rm/weights_checksum/", timeout=300).json()["checksums"]
    bad = [n for n in want if got.get(n) != want[n]]
    return {"tensors": len(want), "mismatched": len(bad), "first_mismatch": bad[0] if bad else None,
            "equal": not bad}


def run(out_dir: str | Path, *, bucket_mbs: tuple[int, ...] = (256, 1024), repeats: int = 3,
        baseline_bytes: int = 2**30, shape: dict[str, int] | None = None, force_cpu: bool = False) -> dict[str, Any]:
    """The benchmark (see module docstring); writes ``out_dir/weight_sync.json`` and returns its content."""
    from trainer.rollout.server_client import ServerEndpoint
    from trainer.sync.transports import NcclTransport
    from trainer.sync.weights import full_weights

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and not force_cpu
    shape = dict(shape or (QWEN3_0_6B if gpu else TINY))
    dtype = torch.bfloat16
    learner_dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(learner_dev)
    else:
        baseline_bytes = min(baseline_bytes, 16 * 2**20)
    env = {**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false"}
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = "1"  # the peer/server process sees the second GPU as its cuda:0
    result: dict[str, Any] = {
        "mode": "gpu" if gpu else "cpu-dry-run (gloo)",
        "backend": "torch (StoreGroup + TorchStatelessCommunicator: ProcessGroupNCCL/Gloo, no vLLM)",
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(2)] if gpu else ["cpu"],
        "nccl": _nccl_version() if gpu else None,
        "shape": shape, "dtype": str(dtype), "date": time.strftime("%Y-%m-%d"),
    }
    t_all = time.perf_counter()
    if gpu:
        result["baseline_copy"] = copy_baseline(baseline_bytes, learner_dev, torch.device("cuda", 1))
        torch.cuda.empty_cache()
        print(f"[bench] copy cuda:0->cuda:1: {result['baseline_copy']['GBps']:.1f} GB/s", flush=True)
    result["baseline_broadcast"] = broadcast_baseline(baseline_bytes, learner_dev, env, "cuda:0" if gpu else "cpu")
    print(f"[bench] raw broadcast: {result['baseline_broadcast']['GBps']:.1f} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        t0 = time.perf_counter()
        model_dir = save_server_model(Path(tmp) / "model", shape, str(learner_dev), dtype)
        result["save_server_model_s"] = time.perf_counter() - t0
        learner = random_qwen3(shape, device=learner_dev, dtype=dtype, seed=1, max_position_embeddings=4096,
                               eos_token_id=1)
        n_params = sum(p.numel() for p in learner.parameters())
        with hf_server(model_dir, env, "cuda:0" if gpu else None, "bfloat16") as (url, start_s):
            result["server_start_s"] = start_s
            syncs = []
            for mb in bucket_mbs:
                with torch.no_grad():  # new weights for every bucket size, so each verification is its own
                    for p in learner.parameters():
                        p.add_(1e-3)
                tensors = full_weights(learner)
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                t0 = time.perf_counter()
                transport = NcclTransport([ServerEndpoint(url)], group_port=_free_port(), timeout_s=300,
                                          bucket_bytes=mb * 2**20, backend="torch",
                                          device=learner_dev.index if gpu else None)
                transport.connect(ServerEndpoint(url))
                connect_s = time.perf_counter() - t0
                pushes = []
                for i in range(repeats + 1):
                    failed = transport.push_full(tensors, [ServerEndpoint(url)])
                    if failed:
                        raise RuntimeError(f"weight push failed: {failed}")
                    st = dict(transport.last_push)
                    st["GBps"] = st["bytes"] / st["seconds"] / GB
                    st["broadcast_GBps"] = st["bytes"] / st["broadcast_s"] / GB
                    st["first"] = i == 0
                    pushes.append(st)
                    print(f"[bench] bucket {mb} MiB push {i}: {st['seconds']:.3f} s, {st['GBps']:.2f} GB/s "
                          f"(broadcast {st['broadcast_GBps']:.2f} GB/s, {st['buckets']} buckets)", flush=True)
                check = _verify(url, tensors)
                transport.close()
                timed = [p for p in pushes if not p["first"]]
                mean_s = sum(p["seconds"] for p in timed) / len(timed)
                bcast_s = sum(p["broadcast_s"] for p in timed) / len(timed)
                syncs.append({"bucket_mb": mb, "connect_s": connect_s, "weights_bytes": nbytes,
                              "sent_bytes": pushes[0]["bytes"], "buckets": pushes[0]["buckets"],
                              "first_push_s": pushes[0]["seconds"], "seconds_mean": mean_s,
                              "seconds_best": min(p["seconds"] for p in timed),
                              "GBps": pushes[0]["bytes"] / mean_s / GB,
                              "broadcast_seconds_mean": bcast_s, "broadcast_GBps": pushes[0]["bytes"] / bcast_s / GB,
                              "pushes": pushes, "verify": check})
                print(f"[bench] bucket {mb} MiB: verify {check}", flush=True)
            result["syncs"] = syncs
    result["params"] = n_params
    for s in result["syncs"]:
        s["vs_broadcast_baseline"] = s["GBps"] / result["baseline_broadcast"]["GBps"]
        if "baseline_copy" in result:
            s["vs_copy_baseline"] = s["GBps"] / result["baseline_copy"]["GBps"]
    result["total_s"] = time.perf_counter() - t_all
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=1))
    print(summary(result), flush=True)
    return result


def summary(result: dict[str, Any]) -> str:
    lines = [f"weight sync benchmark ({result['mode']}, {result['devices']}, torch {result['torch']}, "
             f"nccl {result['nccl']}), {result.get('params', 0) / 1e6:.0f}M params {result['dtype']}"]
    if "baseline_copy" in result:
        lines.append(f"  baseline torch copy cuda:0->cuda:1 (1 GiB): {result['baseline_copy']['GBps']:.1f} GB/s")
    b = result["baseline_broadcast"]
    lines.append(f"  baseline broadcast of one {b['bytes'] / 2**20:.0f} MiB tensor: {b['GBps']:.1f} GB/s")
    for s in result.get("syncs", []):
        lines.append(f"  full sync, bucket {s['bucket_mb']} MiB ({s['buckets']} buckets, {s['sent_bytes'] / GB:.2f} GB): "
                     f"{s['seconds_mean']:.3f} s = {s['GBps']:.1f} GB/s end to end "
                     f"({s['vs_broadcast_baseline']:.0%} of the raw broadcast), broadcasts alone "
                     f"{s['broadcast_GBps']:.1f} GB/s; first push {s['first_push_s']:.2f} s; "
                     f"server weights equal: {s['verify']['equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks")
