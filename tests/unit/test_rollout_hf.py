"""HF rollout backend: microbatching, left padding, stop trimming, strict prompt alignment."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.fixtures import build_tiny_model
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams, PromptAlignmentError, check_prompt_alignment
from trainer.sft.stage2 import Stage2Pipeline


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = build_tiny_model("text", seed=1)
    samples = load_jsonl(generate(tmp_path_factory.mktemp("d"), 5, seed=2, max_objects=3))
    pipe = Stage2Pipeline(PromptEncoder(tok))
    reqs, _ = pipe.requests(samples)
    return model, tok, samples, pipe, reqs


def engine(model, tok, bs):
    return HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), bs)


def test_microbatched_greedy_equals_one_by_one(setup):
    model, tok, _, _, reqs = setup
    assert len({len(r.prompt_token_ids) for r in reqs}) > 1, "prompts of different lengths exercise left padding"
    params = DecodingParams(max_new_tokens=12)
    one = engine(model, tok, 1).generate(reqs, params)
    many = engine(model, tok, 3).generate(reqs, params)
    assert [r.response_token_ids for r in one] == [r.response_token_ids for r in many]
    assert [r.sample_id for r in many] == [r.sample_id for r in reqs]
    check_prompt_alignment(reqs, many)
    assert engine(model, tok, 2).generate([], params) == []


def test_generation_calls_are_microbatched(setup, monkeypatch):
    model, tok, _, _, reqs = setup
    calls = []
    original = model.generate

    def spy(**kw):
        calls.append(kw["input_ids"].shape)
        return original(**kw)

    monkeypatch.setattr(model, "generate", spy)
    engine(model, tok, 2).generate(reqs, DecodingParams(max_new_tokens=4))
    assert [s[0] for s in calls] == [2, 2, 1]


def test_responses_are_stop_trimmed(setup):
    model, tok, _, _, reqs = setup
    free = engine(model, tok, 2).generate(reqs[:2], DecodingParams(max_new_tokens=10))
    assert all(r.truncated and len(r.response_token_ids) == 10 for r in free)
    stop = free[0].response_token_ids[3]
    first = free[0].response_token_ids.index(stop)
    trimmed = HFRolloutEngine(model, tok.pad_token_id, [stop], 2).generate(reqs[:2], DecodingParams(max_new_tokens=10))
    assert trimmed[0].response_token_ids == free[0].response_token_ids[: first + 1]
    assert trimmed[0].finish_reason == "stop"
    assert model.training is False


def test_prompt_mismatch_is_an_error_naming_the_sample(setup):
    model, tok, samples, pipe, reqs = setup
    res = engine(model, tok, 2).generate(reqs[:2], DecodingParams(max_new_tokens=4))
    bad = [res[0], dataclasses.replace(res[1], prompt_token_ids=res[1].prompt_token_ids[1:])]
    with pytest.raises(PromptAlignmentError, match=reqs[1].sample_id):
        pipe.targets(samples[:2], reqs[:2], bad)
    with pytest.raises(PromptAlignmentError, match="order"):
        check_prompt_alignment(reqs[:2], res[::-1])
