"""``loss.logit_chunk_rows``: the stage-2 objective from the LM head's input, a chunk of rows at a time, equals the
all-rows objective (loss, terms, every gradient) on tiny text and VL models, padded and packed, and keeps no
full-vocabulary logits for the backward."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_supervised_logits import _setup, _setup_batch
from trainer.losses.chunked_objective import chunked_objective
from trainer.losses.objective import LossWeights, host_terms, objective_from_rows
from trainer.losses.supervised_logits import supervised_rows
from trainer.packing.packed_batch import pack_targets
from trainer.sft.forward import forward_loss


def _run(model, batch, coord_ids, w, chunk):
    model.zero_grad(set_to_none=True)
    loss, terms, _ = forward_loss(model, batch, coord_ids, w, supervised_logits=True, logit_chunk_rows=chunk)
    loss.backward()
    return float(loss.detach()), host_terms(terms), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


@pytest.mark.parametrize("kind, layout", [("text", "padded"), ("text", "packed"), ("vl", "packed")])
@pytest.mark.parametrize("gate", [1.0, 0.0])
def test_chunked_objective_equals_all_rows(kind, layout, gate):
    model, batch, coord_ids = _setup_batch(kind, layout)
    w = LossWeights(coord_gate=gate)
    want_loss, want_terms, want_grads = _run(model, batch, coord_ids, w, None)
    assert want_terms["tokens/ce"] > 7 and want_terms["tokens/coord"] > 7
    for chunk in (1, 7, 10_000):
        loss, terms, grads = _run(model, batch, coord_ids, w, chunk)
        assert loss == pytest.approx(want_loss, rel=1e-5), chunk
        assert terms.keys() == want_terms.keys(), chunk
        for key, value in want_terms.items():
            assert terms[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (chunk, key)
        assert grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), (chunk, name)


def _rows_batch(n_ce: int, n_coord: int, hidden: int = 16, vocab: int = 4000, k: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = n_ce + n_coord + 1
    hidden_states = torch.randn(1, t, hidden, generator=g, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    positions = torch.randperm(t - 1, generator=g)[:n_ce + n_coord] + 1
    batch = {"ce_index": torch.stack([torch.zeros(n_ce, dtype=torch.long), positions[:n_ce]], 1),
             "ce_labels": torch.randint(0, vocab, (n_ce,), generator=g),
             "coord_index": torch.stack([torch.zeros(n_coord, dtype=torch.long), positions[n_ce:]], 1),
             "coord_targets": torch.rand(n_coord, generator=g) * (k - 1)}
    coord_ids = torch.arange(vocab - k, vocab)
    return hidden_states, head, batch, coord_ids


@pytest.mark.parametrize("n_ce, n_coord", [(0, 9), (9, 0), (0, 0)])
def test_batches_without_ce_rows_or_coord_slots_keep_the_head_in_the_graph(n_ce, n_coord):
    hidden, head, batch, coord_ids = _rows_batch(n_ce, n_coord)
    w = LossWeights()
    want, want_terms = objective_from_rows(supervised_rows(hidden, head, batch, coord_ids), batch, coord_ids, w)
    got, terms = chunked_objective(hidden, head, batch, coord_ids, w, chunk_rows=4)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-9)
    assert host_terms(terms) == pytest.approx(host_terms(want_terms), rel=1e-6, abs=1e-9)
    got.backward()
    assert head.weight.grad is not None, "the LM head left the graph"


def test_no_full_vocabulary_logits_are_kept_for_the_backward():
    """What autograd keeps between forward and backward, outside the checkpointed chunks: the all-rows objective
    keeps at least one float32 [rows, vocab] tensor (the log-softmax); the chunked one keeps the hidden rows."""
    hidden, head, batch, coord_ids = _rows_batch(300, 100, hidden=16, vocab=8000)
    w = LossWeights()
    saved: dict[str, int] = {}

    def measure(key: str, fn) -> None:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        saved[key] = total[0]

    measure("all rows", lambda: objective_from_rows(supervised_rows(hidden, head, batch, coord_ids), batch,
                                                    coord_ids, w))
    measure("chunked", lambda: chunked_objective(hidden, head, batch, coord_ids, w, chunk_rows=32))
    logits_bytes = 400 * 8000 * 4
    assert saved["all rows"] >= logits_bytes, saved
    assert saved["chunked"] < 400 * 16 * 4 * 8, saved  # a few copies of the [rows, hidden] inputs at most
    print(saved)
    assert saved["chunked"] * 20 < saved["all rows"], saved


def test_chunk_rows_must_be_positive_and_coord_only_refuses_the_gate():
    hidden, head, batch, coord_ids = _rows_batch(4, 4)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_objective(hidden, head, batch, coord_ids, LossWeights(), chunk_rows=0)
    with pytest.raises(ValueError, match="coord_gate_weight"):
        chunked_objective(hidden, head, batch, coord_ids, LossWeights(coord_gate=1.0), chunk_rows=2, coord_only=True)


def test_chunks_recompute_under_the_forward_s_autocast():
    """The trainer's forward runs under bf16 autocast (on a GPU): each chunk's recompute in the backward must see the
    same autocast state (bf16 logits) or checkpoint refuses the mismatched tensors; loss and gradients stay those of
    the all-rows objective under the same autocast."""
    model, tok, targets, coord_ids = _setup("text")
    batch = pack_targets(targets, "sdpa", model, None)
    w = LossWeights()
    results = {}
    for chunk in (None, 5):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, terms, _ = forward_loss(model, batch, coord_ids, w, supervised_logits=True, logit_chunk_rows=chunk)
        loss.backward()
        results[chunk] = (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None})
    (want, want_grads), (got, grads) = results[None], results[5]
    assert got == pytest.approx(want, rel=1e-4)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():  # bf16 partial products summed per chunk: compare at bf16's resolution
        assert float((grads[name] - g).norm()) <= 1e-2 * float(g.norm()) + 1e-8, name


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that read a tensor's value to the host (``float()``, ``.item()``, ``.tolist()``): on a
    GPU each is a wait for the device."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunked", [False, True])
def test_the_objective_reads_nothing_to_the_host(chunked):
    """``training.phase_timing: events``: the loss and its terms are computed without reading a value to the host,
    so a row's forward + loss never waits for the device; ``host_terms`` reads them (as the trainer does at log)."""
    hidden, head, batch, coord_ids = _rows_batch(9, 9)
    w = LossWeights()
    with _HostReads() as mode:
        if chunked:
            total, terms = chunked_objective(hidden, head, batch, coord_ids, w, chunk_rows=4)
        else:
            total, terms = objective_from_rows(supervised_rows(hidden, head, batch, coord_ids), batch, coord_ids, w)
    assert mode.reads == 0
    assert isinstance(terms["loss/ce"], torch.Tensor) and not terms["loss/ce"].requires_grad
    with _HostReads() as mode:
        read = host_terms(terms)
    assert mode.reads == sum(isinstance(v, torch.Tensor) for v in terms.values()) == 5
    assert all(type(v) is float for v in read.values())
    assert read["loss/ce"] > 0 and read["tokens/ce"] == 9.0
