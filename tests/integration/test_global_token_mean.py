"""Every rank counts the same: a step trained on two data-parallel ranks (gloo, DDP on the CPU) whose records hold
different token counts gives the gradients, before the optimizer step, of one process training all of the step's
records, and logs the loss of that process. The step's CE and coord denominators are every rank's tokens and each
rank's loss is weighted by the world size, so DDP's averaging of the ranks' gradients is the step's token mean
(``RolloutMatchingTrainer._step_totals``); full fine-tuning, LoRA and DoRA, padded micro-batches and packed rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.launch.ports import listen_port
from trainer.modeling.fixtures import build_tiny_model
from trainer.packing.buffer import PackingBuffer
from trainer.sft.settings import LayoutSettings
from trainer.sft.trainer import RolloutMatchingTrainer, ledger_name

WORLD = 2
PER_RANK = 3
CASES = (("full", "padded"), ("lora", "padded"), ("dora", "padded"), ("full", "packed"))


class CountingTrainer(RolloutMatchingTrainer):
    """Records this rank's own CE and coord counts, before they are summed over the ranks."""

    local_counts: list[tuple[int, int]] = []

    def _step_totals(self, ce, coord):
        self.local_counts.append((ce, coord))
        return super()._step_totals(ce, coord)


class GradientsBeforeStep(TrainerCallback):
    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(tuner: str):
    model = build_tiny_model("text", seed=0)[0]
    if tuner == "full":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                             use_dora=tuner == "dora"))
    for name, p in model.named_parameters():  # LoRA's B starts at zero: give A a gradient to compare too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _train(out: Path, samples, tuner: str, layout: str, per_device: int, micro_batch_rows: int):
    """One step; (gradients before the optimizer step, the step's log record, this rank's local counts, the ids of
    the samples it trained)."""
    CountingTrainer.local_counts = []
    (out / "out").mkdir(parents=True, exist_ok=True)
    capture = GradientsBeforeStep()
    packing = PackingBuffer(2048, 64) if layout == "packed" else None
    trainer = tiny_stage2_trainer(out, model=_model(tuner), samples=samples, per_device=per_device,
                                  target_source="ground_truth", trainer_class=CountingTrainer,
                                  args={"max_grad_norm": 0.0, "seed": 0}, packing=packing,
                                  layout=LayoutSettings(micro_batch_rows=micro_batch_rows), callbacks=[capture])
    trainer.train()
    record = next(r for r in trainer.state.log_history if "loss" in r)
    ledger = Path(trainer.args.output_dir) / ledger_name(trainer.args.process_index)
    ids = [json.loads(line)["sample_id"] for line in ledger.read_text().splitlines()]
    return capture.grads, record, list(CountingTrainer.local_counts), ids


def _rank(rank: int, port: int, data: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    samples = load_jsonl(data)
    results = {}
    for tuner, layout in CASES:
        results[(tuner, layout)] = _train(Path(out) / f"ranks-{tuner}-{layout}", samples, tuner, layout, PER_RANK, 1)
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks' results (spawned once for every case) and the one-process reference of each case."""
    root = tmp_path_factory.mktemp("global_mean")
    data = generate(root / "data", WORLD * PER_RANK, seed=5, min_objects=1, max_objects=6)
    torch.multiprocessing.spawn(_rank, args=(listen_port(), str(data), str(root)), nprocs=WORLD, join=True)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    samples = load_jsonl(data)
    reference = {case: _train(root / f"one-{case[0]}-{case[1]}", samples, *case, WORLD * PER_RANK, 2)
                 for case in CASES}
    # each rank's records alone in one process (full, padded): its own token mean, what DDP averaged before
    by_id = {s.sample_id: s for s in samples}
    case = CASES[0]
    alone = [_train(root / f"alone{r}", [by_id[i] for i in ranks[r][case][3]], *case, PER_RANK, 1)[0]
             for r in range(WORLD)]
    return ranks, reference, alone


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_two_ranks_with_different_token_counts_give_the_gradients_of_one_process(runs, case):
    ranks, reference, alone = runs
    grads, record, counts, ids = reference[case]
    (g0, rec0, counts0, ids0), (g1, _, counts1, ids1) = ranks[0][case], ranks[1][case]
    assert sorted(ids0 + ids1) == sorted(ids) and not set(ids0) & set(ids1), "the ranks split the step's records"
    ce0, ce1 = counts0[0][0], counts1[0][0]
    assert ce0 + ce1 == counts[0][0] and counts0[0][1] + counts1[0][1] == counts[0][1], "the ranks hold every token"
    assert abs(ce0 - ce1) >= 0.1 * max(ce0, ce1), f"the ranks' token counts should differ: {ce0} and {ce1}"
    assert grads and set(g0) == set(grads) == set(g1)
    for name, want in grads.items():
        assert torch.allclose(g0[name], g1[name]), f"{name}: DDP gave the ranks different gradients"
        assert torch.allclose(g0[name], want, rtol=1e-4, atol=1e-7), \
            f"{name}: {(g0[name] - want).abs().max():.3g} off the one-process gradient"
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    if case == CASES[0]:
        mean_of_means = {n: (alone[0][n] + alone[1][n]) / 2 for n in grads}
        assert not all(torch.allclose(mean_of_means[n], want, rtol=1e-4, atol=1e-7) for n, want in grads.items()), \
            "the average of each rank's own token mean is another gradient: the comparison can fail"
    # the logged loss and terms are the step's, over every rank's tokens (rank 0 logs them)
    for key in ("loss", "loss/ce", "loss/coord", "tokens/ce", "tokens/coord"):
        assert rec0[key] == pytest.approx(record[key], rel=1e-4), key
