"""Runs offload_for_rollout against a real single-process DeepSpeed engine and prints one JSON report line.

Used by test_offload_deepspeed.py (a subprocess per configuration: DeepSpeed initialises torch.distributed and its
accelerator globally) and, with --bench, to measure bytes/time. CPU-only hosts: DS_ACCELERATOR=cpu, gloo, world
size 1, and ``--simulate`` makes every move of our own code copy into fresh storage (DeepSpeed's own pinned-buffer
path already does), so a stale view shows up as on a real GPU round-trip. On a CUDA host the moves are real.

    python tests/integration/ds_offload_worker.py --stage 2 [--optim torch|fused] [--simulate] [--bench]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

REPORT = "OFFLOAD_REPORT "


def _env() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def build(stage: int, optim: str, hidden: int = 32, layers: int = 2, frozen: bool = True, seed: int = 0):
    import deepspeed
    import torch

    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    if frozen:  # a frozen front layer (LoRA-base-like): not managed by ZeRO-1/2's optimizer
        mods.append(torch.nn.Linear(16, 16).requires_grad_(False))
    mods += [torch.nn.Linear(16, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, 4))
    model = torch.nn.Sequential(*mods)
    params = [p for p in model.parameters() if p.requires_grad]
    if optim == "fused":
        from deepspeed.ops.adam import FusedAdam
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    zero: dict = {"stage": stage}
    if stage == 2:
        zero.update(reduce_bucket_size=64, allgather_bucket_size=64)  # several buckets even on a tiny model
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, reduce_bucket_size=64, stage3_prefetch_bucket_size=64)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_allow_untested_optimizer": True,
           "bf16": {"enabled": True}, "zero_optimization": zero, "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def batches(n: int, device):
    import torch

    g = torch.Generator().manual_seed(123)
    return [torch.randn(2, 16, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(n)]


def micro(engine, x) -> float:
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss)


def snapshot(engine) -> dict:
    """Every piece of training state, cloned to CPU (keys stable across engines built the same way)."""
    import torch

    z = engine.optimizer
    out = {}
    for i, p in enumerate(engine.module.parameters()):
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        out[f"param{i}"] = t.detach().float().cpu().clone()
    hp = z.fp32_partitioned_groups_flat if hasattr(z, "fp32_partitioned_groups_flat") else \
        z.single_partition_of_fp32_groups
    for i, t in enumerate(hp):
        out[f"hp{i}"] = t.detach().cpu().clone()
    for i, state in enumerate(z.optimizer.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not k.endswith("_offload_buffer"):
                out[f"opt{i}.{k}"] = v.detach().float().cpu().clone()
    if hasattr(z, "grad_partitions_flat_buffer"):
        out["grads"] = z.grad_partitions_flat_buffer.detach().float().cpu().clone()
    else:
        for g, grads in z.averaged_gradients.items():
            for j, t in enumerate(grads or []):
                if t is not None:
                    out[f"grad{g}.{j}"] = t.detach().float().cpu().clone()
    for i, p in enumerate(engine.module.parameters()):
        if p.grad is not None:
            out[f"pgrad{i}"] = p.grad.detach().float().cpu().clone()
    return out


def diff(a: dict, b: dict) -> list[str]:
    import torch

    bad = sorted(set(a) ^ set(b))
    bad += [k for k in sorted(set(a) & set(b)) if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return bad


def views_intact(engine) -> bool:
    """ZeRO-1/2: every managed bf16 parameter is a view of its group's flat buffer (what the optimizer writes)."""
    z = engine.optimizer
    if not hasattr(z, "bit16_groups_flat"):
        return True
    for flat, group in zip(z.bit16_groups_flat, z.bit16_groups):
        lo = flat.data_ptr()
        hi = lo + flat.numel() * flat.element_size()
        if any(not (lo <= p.data_ptr() < hi) for p in group):
            return False
    return True


def param_data_devices(engine) -> list[str]:
    """Devices of the tensors that hold each parameter's values. Under ZeRO-3 that is the partition ``p.ds_tensor``:
    ``p.data`` of a released ZeRO-3 parameter is a 0-element placeholder DeepSpeed keeps on the accelerator (it holds
    no memory, and gathering allocates on the accelerator whatever its device), so ``p.device`` says cuda:0 even when
    every byte is on the host. DeepSpeed's own ``get_state_devices(lp_params)`` looks at ``ds_tensor`` too."""
    return sorted({str((p.ds_tensor if hasattr(p, "ds_tensor") else p).device) for p in engine.module.parameters()})


def gathered_zero3_params(engine) -> int:
    """ZeRO-3 parameters whose ``p.data`` holds values (gathered, not released): a full copy that would stay put."""
    return sum(1 for p in engine.module.parameters() if hasattr(p, "ds_tensor") and p.data.numel() > 0)


def accelerator_state_bytes(engine) -> dict:
    """Bytes of training state on an accelerator, per kind, by the tensors' real devices (not the --simulate switch,
    so on CPU hosts this is always empty; on a GPU it names whatever the offload left behind)."""
    import torch

    z = engine.optimizer
    params = list(engine.module.parameters())
    kinds = {
        "params": [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in params],
        "gathered_zero3_params": [p.data for p in params if hasattr(p, "ds_tensor")],
        "param_grads": [p.grad for p in params],
        "lp_flat": list(getattr(z, "bit16_groups_flat", None) or [getattr(z, "lp_param_buffer", None)]),
        "hp_params": list(getattr(z, "fp32_partitioned_groups_flat", None) or z.single_partition_of_fp32_groups),
        "optim_states": [v for s in z.optimizer.state.values() for v in s.values()],
        "lp_grads": [getattr(z, "grad_partitions_flat_buffer", None)]
        + [t for g in getattr(z, "averaged_gradients", {}).values() for t in (g or [])],
    }
    out = {}
    for kind, tensors in kinds.items():
        n = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu")
        if n:
            out[kind] = n
    return out


def host_storage_ids(engine) -> dict:
    z = engine.optimizer
    flats = getattr(z, "bit16_groups_flat", None) or [z.lp_param_buffer]
    return {"lp": [t.data_ptr() for t in flats]}


def scenario(stage: int, optim: str) -> dict:
    """Offload at four points of two optimizer steps (GA=2: before the first micro-batch, with a gradient pending,
    at the step boundary, pending again; one of them exits by exception), vs a reference engine without offload."""
    import torch

    from trainer.memory.offload import OffloadUnsupportedError, offload_for_rollout

    frozen = os.environ.get("OFFLOAD_FROZEN", "1") == "1"
    ref, eng = build(stage, optim, frozen=frozen), build(stage, optim, frozen=frozen)
    xs = batches(4, eng.device)
    rep: dict = {"stage": stage, "optim": optim, "points": []}
    initial = snapshot(eng)
    rep["initial_equal_to_ref"] = not diff(initial, snapshot(ref))
    for i, x in enumerate(xs):
        before = snapshot(eng)
        ptr_before = host_storage_ids(eng)
        point = {"micro": i, "raised": False}
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            point["cuda_bytes_before"] = torch.cuda.memory_allocated()
        try:
            with offload_for_rollout(eng, eng.optimizer, True, True) as stats:
                point["inside_offloaded_states"] = sorted(s.value for s in eng.optimizer.offloaded_states)
                point["inside_lp_storage_changed"] = host_storage_ids(eng) != ptr_before
                point["inside_param_devices"] = param_data_devices(eng)
                point["inside_gathered_zero3_params"] = gathered_zero3_params(eng)
                point["inside_accelerator_bytes"] = accelerator_state_bytes(eng)
                if cuda:
                    point["cuda_bytes_inside"] = torch.cuda.memory_allocated()
                if i == 2:
                    raise RuntimeError("decode failed")
        except RuntimeError as exc:
            if str(exc) != "decode failed":
                raise
            point["raised"] = True
        point["after_offloaded_states"] = sorted(s.value for s in eng.optimizer.offloaded_states)
        point["round_trip_diff"] = diff(before, snapshot(eng))
        point["views_intact"] = views_intact(eng)
        point["stats"] = {"param_bytes": stats.moved_param_bytes, "optimizer_bytes": stats.moved_optimizer_bytes,
                          "backend": stats.backend}
        rep["points"].append(point)
        rep.setdefault("losses", []).append(micro(eng, x))
        rep.setdefault("ref_losses", []).append(micro(ref, x))
    final, final_ref = snapshot(eng), snapshot(ref)
    rep["final_diff"] = diff(final, final_ref)
    rep["trained"] = bool(diff(initial, final_ref))  # the steps changed the state: the equality is not vacuous
    rep["global_steps"] = [eng.global_steps, ref.global_steps]
    try:  # the bare module with the ZeRO optimizer (what HF's Trainer.model is) must be refused
        with offload_for_rollout(eng.module, eng.optimizer):
            pass
        rep["bare_module_refused"] = ""
    except OffloadUnsupportedError as exc:
        rep["bare_module_refused"] = str(exc)
    return rep


def negative_control(stage: int) -> dict:
    """The plain-torch path applied to a ZeRO-1/2 engine's bare module (what the guard refuses): parameters get new
    storage, the flat bf16 buffer the optimizer owns stays where it was, so nothing is freed on a GPU and the
    parameters are detached from the buffer until DeepSpeed's next step re-points them."""
    from trainer.memory import offload as off

    eng = build(stage, "torch")
    micro(eng, batches(1, eng.device)[0])
    flat_before = host_storage_ids(eng)
    moved = off._offload_params(eng.module.parameters(), off.OffloadStats(), False)
    rep = {"views_intact_inside": views_intact(eng), "flat_moved": host_storage_ids(eng) != flat_before}
    off._restore_params(moved)
    rep["views_intact_after"] = views_intact(eng)
    return rep


def bench(stage: int, optim: str, hidden: int, layers: int, repeats: int) -> dict:
    import torch

    from trainer.memory.offload import offload_for_rollout

    eng = build(stage, optim, hidden=hidden, layers=layers, frozen=False)
    xs = batches(2, eng.device)
    for x in xs:
        micro(eng, x)
    n = sum(getattr(p, "ds_numel", p.numel()) for p in eng.module.parameters())
    times_off, times_on, stats = [], [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        cm = offload_for_rollout(eng, eng.optimizer, True, True)
        stats = cm.__enter__()
        t1 = time.perf_counter()
        cm.__exit__(None, None, None)
        t2 = time.perf_counter()
        times_off.append(t1 - t0)
        times_on.append(t2 - t1)
    mem = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    return {"stage": stage, "optim": optim, "params": n, "param_bytes": stats.moved_param_bytes,
            "optimizer_bytes": stats.moved_optimizer_bytes, "offload_s": min(times_off), "reload_s": min(times_on),
            "peak_during_gib": stats.peak_during_gib, "cuda_allocated_after": mem}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--optim", default="torch", choices=["torch", "fused"])
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--negative-control", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    _env()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from trainer.memory import offload as off

    off._SIMULATE_DEVICE_MOVES = args.simulate
    try:
        if args.bench:
            rep = bench(args.stage, args.optim, args.hidden, args.layers, args.repeats)
        elif args.negative_control:
            rep = negative_control(args.stage)
        else:
            rep = scenario(args.stage, args.optim)
    except Exception as exc:  # reported, so the test shows the DeepSpeed error instead of a bare exit code
        rep = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(REPORT + json.dumps(rep), flush=True)


if __name__ == "__main__":
    main()
