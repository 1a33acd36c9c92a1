"""The train-inference mismatch (``trainer.sft.mismatch``): which rollout tokens are compared, the learner's side of
the comparison, the summary, and a stage-2 trainer whose engine is its own policy (near zero) or a stale copy of it
(a sync that never ran: the gap shows, and a warning names it)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.data.output_format import serialize_objects
from trainer.modeling.fixtures import build_tiny_model, tiny_tokenizer
from trainer.rollout.types import DecodingParams, RolloutResult
from trainer.sft.mismatch import MismatchStats, kept_engine_logprobs, learner_logprobs, summary
from trainer.sft.settings import RolloutSettings
from trainer.telemetry import read_jsonl


def test_kept_tokens_stop_at_the_first_re_encoded_one():
    lps = [{5: -0.1}, {6: -0.2}, {7: -0.3}, {8: -0.4}]
    assert kept_engine_logprobs(10, [5, 6, 7, 8], [5, 6, 9], lps) == [(10, -0.1), (11, -0.2)]
    assert kept_engine_logprobs(10, [5, 6], [5, 6, 7], lps) == [(10, -0.1), (11, -0.2)]
    assert kept_engine_logprobs(10, [5, 6], [5, 6], None) == []


def test_learner_logprobs_read_the_row_before_each_token_at_the_decoding_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    index = torch.tensor([[0, 1], [1, 4]])
    for temperature in (0.0, 0.7):
        got = learner_logprobs(logits, None, ids, index, temperature)
        scale = temperature or 1.0
        want = [torch.log_softmax(logits[r, c - 1] / scale, -1)[ids[r, c]] for r, c in index.tolist()]
        assert torch.allclose(got, torch.stack(want))
    head = torch.nn.Linear(4, 11, bias=False)
    hidden = torch.randn(2, 5, 4)
    assert torch.allclose(learner_logprobs(hidden, head, ids, index, 0.0),
                          learner_logprobs(head(hidden), None, ids, index, 0.0))


def test_stats_add_up_and_k3_is_the_kl_estimate():
    learner, engine = torch.tensor([-0.1, -2.0, -0.5]), torch.tensor([-0.1, -1.0, -0.7])
    stats = MismatchStats()
    stats.add(MismatchStats.of(learner[:2], engine[:2]))
    stats.add(MismatchStats.of(learner[2:], engine[2:]))
    stats.add(MismatchStats.of(learner[:0], engine[:0]))
    out = summary(*stats.totals())
    d = learner - engine
    assert out["mismatch/tokens"] == 3
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(float(d.abs().mean()))
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(1.0)
    assert out["mismatch/kl_k3"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()))
    assert summary(*MismatchStats().totals()) == {}


class ScoringEngine:
    """Answers every request with its sample's ground truth, scored by ``model``: the log-probabilities an engine
    holding ``model``'s weights would report for those tokens (greedy: the raw distribution)."""

    name = "scoring"

    def __init__(self, model, samples):
        self.model = model
        tok = tiny_tokenizer()
        self.answers = {s.sample_id: tok(serialize_objects(s.objects), add_special_tokens=False)["input_ids"]
                        + [tok.eos_token_id] for s in samples}

    @torch.no_grad()
    def generate(self, requests, params):
        assert params.logprobs == 0, "the trainer asks for the sampled tokens' log-probabilities"
        out = []
        for r in requests:
            response = self.answers[r.sample_id]
            ids = torch.tensor([list(r.prompt_token_ids) + response])
            lp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), -1)
            n = len(r.prompt_token_ids)
            logprobs = tuple({t: float(lp[n + i - 1, t])} for i, t in enumerate(response))
            out.append(RolloutResult(r.sample_id, r.prompt_token_ids, tuple(response), logprobs=logprobs))
        return out


def _train(tmp_path, stale: bool, caplog):
    from trainer.data.records import load_jsonl
    from trainer.data.synthetic import generate

    samples = load_jsonl(generate(tmp_path / "data", 6, seed=0, max_objects=2))
    model = build_tiny_model("text", seed=0)[0]
    trainer = tiny_stage2_trainer(tmp_path, model=model, samples=samples, max_steps=3, per_device=2,
                                  args={"learning_rate": 3e-3},
                                  rollout=RolloutSettings(decoding=DecodingParams(max_new_tokens=8), mismatch_warn=0.05))
    trainer.engine = ScoringEngine(copy.deepcopy(model).eval() if stale else model, samples)
    with caplog.at_level(logging.WARNING, logger="trainer.sft.trainer"):
        trainer.train()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "mismatch/tokens" in r] \
        if (tmp_path / "out" / "metrics.jsonl").exists() else []
    return trainer, rows


def test_an_engine_that_is_the_policy_shows_no_gap_and_a_stale_one_does(tmp_path, caplog):
    logs = []
    for stale in (False, True):
        trainer, _ = _train(tmp_path / str(stale), stale, caplog)
        logs.append([h for h in trainer.state.log_history if "mismatch/tokens" in h])
    fresh, stale = logs
    assert len(fresh) == len(stale) == 3 and all(h["mismatch/tokens"] > 20 for h in fresh + stale)
    assert all(h["mismatch/logp_abs_diff_mean"] < 1e-4 for h in fresh), fresh
    # the first step decodes on the weights the learner starts from; later steps on weights it has left behind
    assert stale[0]["mismatch/logp_abs_diff_mean"] < 1e-4
    assert all(h["mismatch/logp_abs_diff_mean"] > 0.05 for h in stale[1:]), stale
    assert all(h["mismatch/kl_k3"] > 0 and h["mismatch/logp_abs_diff_max"] >= h["mismatch/logp_abs_diff_mean"]
               for h in stale[1:])
    assert "not decoding with the policy being trained" in caplog.text
    assert math.isfinite(stale[-1]["mismatch/kl_k3"])
