"""One rank of a DeepSpeed ZeRO run (CPU accelerator, gloo) that writes to ``OUT/rank<N>.json``, per ZeRO stage, the
bytes DeepSpeed holds on this rank beside what the learner's memory plan
(``trainer.modeling.checkpointing.resident_bytes``) charges for it.

Started by tests/integration/test_zero_memory_plan.py through torchrun (``--nproc-per-node 2``). Each stage builds an
engine from the trainer's own preset (``trainer.sft.deepspeed_config.preset``) around a bf16 model with a frozen
front layer and torch's AdamW, runs two optimizer steps of two micro-batches each, and takes the largest gradient
bytes seen after any backward (inside the accumulation window and at its boundary). Held bytes are counted by the
storages of the tensors DeepSpeed's objects point at, each storage once (a view of a flat buffer counts the
buffer).

    torchrun --nproc-per-node 2 tests/integration/ds_memory_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _model():
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64).requires_grad_(False), torch.nn.Linear(64, 256)]
    layers += [torch.nn.Linear(256, 256) for _ in range(3)]
    layers.append(torch.nn.Linear(256, 7))  # an odd count of trained elements: the partitions need padding
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _config(stage: int, world: int) -> dict:
    from trainer.sft.deepspeed_config import preset

    cfg = preset(f"zero{stage}")
    cfg.update(bf16={"enabled": True}, fp16={"enabled": False}, gradient_accumulation_steps=2, gradient_clipping=1.0,
               train_micro_batch_size_per_gpu=2, train_batch_size=4 * world)
    cfg["zero_optimization"]["reduce_bucket_size"] = 65536  # HF fills "auto" from the model; several buckets here
    if stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size=65536, stage3_param_persistence_threshold=0)
    return cfg


def _held(tensors) -> int:
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _gradients(engine) -> int:
    z = engine.optimizer
    params = list(engine.module.parameters())
    tensors = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    tensors += [t for group in getattr(z, "averaged_gradients", {}).values() for t in (group or [])]
    tensors += [t for group in getattr(z, "all_grad_tensors", {}).values() for t in (group or [])]
    tensors += [getattr(z, "grad_partitions_flat_buffer", None), getattr(z, "grads_in_partition", None)]
    return _held(tensors)


def stage_report(stage: int, world: int) -> dict:
    import deepspeed
    import torch

    from trainer.modeling.checkpointing import resident_bytes

    model = _model()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters() if p.requires_grad)
    planned = resident_bytes(model, f"zero{stage}", world)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, world))
    x = torch.randn(2, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    gradients = 0
    for _ in range(4):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        gradients = max(gradients, _gradients(engine))
        engine.step()
    z = engine.optimizer
    weights = _held([p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in engine.module.parameters()])
    master = list(getattr(z, "fp32_partitioned_groups_flat", None) or z.single_partition_of_fp32_groups)
    states = _held(master) + _held([v for s in z.optimizer.state.values() for k, v in s.items() if k != "step"])
    return {"trained": trained, "total": total, "largest": largest, "planned": planned, "weights": weights,
            "gradients": gradients, "master_and_states": states, "held": weights + gradients + states,
            "steps": engine.global_steps}


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, os.getcwd())
    out = Path(sys.argv[1])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    report = {str(stage): stage_report(stage, world) for stage in (1, 2, 3)}
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "stages": report}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # the report is written: the interpreter's teardown, with DeepSpeed's CPU communication loaded, has aborted
    # under load ("terminate called without an active exception"), which is not what this test measures
    os._exit(0)


if __name__ == "__main__":
    main()
