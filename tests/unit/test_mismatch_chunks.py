"""The mismatch metric's learner side (``trainer.sft.mismatch.learner_logprobs``) a chunk of tokens at a time: the
same log-probabilities as all at once, no more than ``chunk_rows`` rows of logits alive per projection, no autograd,
and ``forward_loss`` chunks it by ``loss.logit_chunk_rows``."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_supervised_logits import _setup_batch
from trainer.losses.objective import LossWeights
from trainer.sft.forward import forward_loss
from trainer.sft.mismatch import MismatchStats, learner_logprobs


class RowCountingHead(torch.nn.Module):
    """A linear head that records the row count and grad mode of each call."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, vocab, bias=False)
        self.calls: list[tuple[int, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.shape[:-1].numel(), torch.is_grad_enabled()))
        return self.linear(x)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 9, 6, generator=g, requires_grad=True)
    ids = torch.randint(0, 13, (3, 9), generator=g)
    index = torch.tensor([[r, c] for r in range(3) for c in range(1, 9) if (r + c) % 3])  # 16 tokens
    return hidden, ids, index


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_chunked_equals_all_at_once(temperature):
    hidden, ids, index = _case()
    head = RowCountingHead(6, 13)
    want = learner_logprobs(hidden, head, ids, index, temperature, None)
    want_logits = learner_logprobs(head(hidden), None, ids, index, temperature, None)
    assert want.shape == (index.shape[0],) and torch.allclose(want, want_logits, atol=1e-6)
    for chunk in (1, 3, 5, index.shape[0], index.shape[0] + 7):
        got = learner_logprobs(hidden, head, ids, index, temperature, chunk)
        assert torch.allclose(got, want, atol=1e-6), chunk
        got_logits = learner_logprobs(head(hidden).detach(), None, ids, index, temperature, chunk)
        assert torch.allclose(got_logits, want, atol=1e-6), chunk


def test_each_projection_holds_at_most_chunk_rows():
    hidden, ids, index = _case(1)
    n = index.shape[0]
    for chunk, calls in ((1, n), (5, 4), (n + 7, 1)):
        head = RowCountingHead(6, 13)
        learner_logprobs(hidden, head, ids, index, 0.0, chunk)
        rows = [r for r, _ in head.calls]
        assert len(rows) == calls and sum(rows) == n and max(rows) <= chunk, (chunk, rows)
    head = RowCountingHead(6, 13)
    learner_logprobs(hidden, head, ids, index, 0.0, None)
    assert [r for r, _ in head.calls] == [n]


def test_logits_given_are_log_softmaxed_a_chunk_at_a_time(monkeypatch):
    hidden, ids, index = _case(2)
    logits = torch.nn.Linear(6, 13, bias=False)(hidden).detach()
    sizes = []
    real = torch.log_softmax

    def recording(x, *args, **kwargs):
        sizes.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", recording)
    learner_logprobs(logits, None, ids, index, 0.5, 4)
    assert sizes == [4, 4, 4, 4]


def test_runs_without_autograd():
    hidden, ids, index = _case(3)
    head = RowCountingHead(6, 13)
    out = learner_logprobs(hidden, head, ids, index, 0.0, 4)
    assert not out.requires_grad and out.grad_fn is None
    assert head.calls and not any(grad for _, grad in head.calls)
    assert torch.is_grad_enabled()
    with pytest.raises(ValueError, match="chunk_rows"):
        learner_logprobs(hidden, head, ids, index, 0.0, 0)
    empty = learner_logprobs(hidden, head, ids, index[:0], 0.0, 4)
    assert empty.shape == (0,) and empty.dtype == torch.float32


def _with_rollout_tokens(batch):
    """``batch`` with every position past the first of each row as a kept rollout token (engine log-prob 0)."""
    b, t = batch["input_ids"].shape
    index = torch.tensor([[r, c] for r in range(b) for c in range(1, t)])
    return {**batch, "logp_index": index, "logp_engine": torch.zeros(index.shape[0])}


@pytest.mark.parametrize("supervised", [True, False])
def test_forward_loss_chunks_the_metric_by_logit_chunk_rows(supervised, monkeypatch):
    model, batch, coord_ids = _setup_batch("text", "padded")
    batch = _with_rollout_tokens(batch)
    n = batch["logp_index"].shape[0]
    assert n > 20
    sizes = []
    real = torch.log_softmax

    def recording(x, *args, **kwargs):
        if not torch.is_grad_enabled():  # the loss runs under autograd; the metric does not
            sizes.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", recording)
    totals = {}
    for chunk in (None, 1, 7, n + 5):
        sizes.clear()
        stats = MismatchStats()
        forward_loss(model, batch, coord_ids, LossWeights(), supervised_logits=supervised, logit_chunk_rows=chunk,
                     mismatch=stats, temperature=0.8)
        assert stats.tokens == n
        assert sum(sizes) == n and max(sizes) <= (chunk or n), (chunk, sizes)
        totals[chunk] = stats.totals()
    for chunk, got in totals.items():
        assert got == pytest.approx(totals[None], rel=1e-5, abs=1e-6), chunk
