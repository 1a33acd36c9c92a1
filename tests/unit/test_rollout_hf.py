"""HF rollout backend: microbatching, left padding, stop trimming, strict prompt alignment; static KV cache and
compiled decoding give the same greedy results as the dynamic path (text and Qwen3-VL)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from trainer.config.errors import ConfigErrors
from trainer.config.schema import validate_config
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model
from trainer.modeling.loading import LoadedModel
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.factory import build_rollout_engine
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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_responses_are_stop_trimmed(setup, cache):
    model, tok, _, _, reqs = setup
    free = engine(model, tok, 2).generate(reqs[:2], DecodingParams(max_new_tokens=10))
    assert all(r.truncated and len(r.response_token_ids) == 10 for r in free)
    stop = free[0].response_token_ids[3]
    first = free[0].response_token_ids.index(stop)
    trimmed = HFRolloutEngine(model, tok.pad_token_id, [stop], 2, cache_implementation=cache).generate(
        reqs[:2], DecodingParams(max_new_tokens=10))
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


def chaotic(kind: str):
    """A tiny model whose greedy outputs depend on the prompt (the default init repeats one token forever, which
    would make equality tests pass trivially): language-model matrices redrawn with a larger std."""
    model, tok = build_tiny_model(kind, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "visual" not in name:
                p.normal_(0.0, 0.2, generator=gen)
    return model, tok


@pytest.fixture(scope="module", params=["text", "vl"])
def varied(request):
    """Prompts of different lengths (for VL: two image sizes → different image-token counts) so left padding and
    the static cache's masked tail are exercised, with mm inputs for VL."""
    kind = request.param
    model, tok = chaotic(kind)
    root = Path(tempfile.mkdtemp())
    samples = (load_jsonl(generate(root / "a", 3, seed=2, max_objects=3))
               + load_jsonl(generate(root / "b", 3, seed=3, max_objects=3, image_size=96)))
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor() if kind == "vl" else None))
    reqs, _ = pipe.requests(samples)
    assert len({len(r.prompt_token_ids) for r in reqs}) > 1
    assert all(bool(r.mm_inputs) == (kind == "vl") for r in reqs)
    image_token_id = getattr(model.config, "image_token_id", None)

    def run(batch_size, **kw):
        eng = HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), batch_size, image_token_id, **kw)
        return eng.generate(reqs, DecodingParams(max_new_tokens=16))

    baseline = [r.response_token_ids for r in run(1)]
    assert len(set(baseline)) >= 3 and all(len(set(r)) > 4 for r in baseline), "outputs must vary with the prompt"
    return model, reqs, run, baseline


@pytest.mark.parametrize("batch_size, knobs", [
    (4, {}),
    (1, {"cache_implementation": "static"}),
    (4, {"cache_implementation": "static"}),
    (4, {"cache_implementation": "static", "prompt_pad_multiple": 64}),
    (4, {"cache_implementation": "static", "compile": True, "compile_backend": "eager"}),
], ids=["dynamic-b4", "static-b1", "static-b4", "static-b4-pad64", "static-b4-compiled"])
def test_static_cache_and_batching_keep_greedy_results(varied, batch_size, knobs):
    model, reqs, run, baseline = varied
    model.__dict__.pop("_compiled_call", None)
    results = run(batch_size, **knobs)
    assert [r.response_token_ids for r in results] == baseline
    check_prompt_alignment(reqs, results)
    assert hasattr(model, "_compiled_call") == bool(knobs.get("compile")), "compiled decoding iff hf.compile"


@pytest.mark.slow
def test_inductor_compiled_decoding_matches_dynamic(varied):
    model, reqs, run, baseline = varied
    model.__dict__.pop("_compiled_call", None)
    results = run(4, cache_implementation="static", compile=True, compile_mode="default", prompt_pad_multiple=32)
    assert [r.response_token_ids for r in results] == baseline


def test_compiled_partial_batch_is_filled_to_a_fixed_shape(setup, monkeypatch):
    model, tok, _, _, reqs = setup
    calls = []
    original = model.generate

    def spy(**kw):
        calls.append((tuple(kw["input_ids"].shape), kw.get("cache_implementation"), kw.get("disable_compile")))
        return original(**kw)

    monkeypatch.setattr(model, "generate", spy)
    params = DecodingParams(max_new_tokens=6)
    eng = HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 2, cache_implementation="static",
                          compile=True, compile_backend="eager", prompt_pad_multiple=64)
    out = eng.generate(reqs, params)
    assert [s[0] for s, _, _ in calls] == [2, 2, 2] and all(s[1] % 64 == 0 for s, _, _ in calls)
    assert all(c == "static" and d is False for _, c, d in calls)
    assert [r.sample_id for r in out] == [r.sample_id for r in reqs]
    check_prompt_alignment(reqs, out)
    calls.clear()
    HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 2,
                    cache_implementation="static").generate(reqs, params)
    assert [s[0] for s, _, _ in calls] == [2, 2, 1], "without compile the last microbatch is not filled"
    assert all(d is True for _, _, d in calls), "static cache without hf.compile must not auto-compile on CUDA"


def test_unsupported_models_fail_at_construction(setup, monkeypatch):
    model, tok, _, _, _ = setup
    monkeypatch.setattr(type(model), "_can_compile_fullgraph", False)
    with pytest.raises(ValueError, match="hf.compile is not supported by Qwen3ForCausalLM"):
        HFRolloutEngine(model, tok.pad_token_id, [1], 2, cache_implementation="static", compile=True)
    HFRolloutEngine(model, tok.pad_token_id, [1], 2, cache_implementation="static")
    monkeypatch.setattr(type(model), "_supports_default_dynamic_cache", classmethod(lambda cls: False))
    with pytest.raises(ValueError, match="static is not supported"):
        HFRolloutEngine(model, tok.pad_token_id, [1], 2, cache_implementation="static")
    with pytest.raises(ValueError, match="needs hf.cache_implementation: static"):
        HFRolloutEngine(model, tok.pad_token_id, [1], 2, compile=True)


BASE = {"model": {"tiny": "text"}, "data": {"synthetic": {"num_samples": 4}}}


def rm_config(**rm):
    return {**BASE, "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", **rm}}}}


def test_hf_section_validates_and_is_wired_by_the_factory(setup):
    model, tok, _, _, _ = setup
    cfg = validate_config(rm_config(rollout_generate_batch_size=8, hf={
        "cache_implementation": "static", "compile": True, "compile_mode": "default", "prompt_pad_multiple": 64}))
    loaded = LoadedModel(model, tok, None, Path("."), "qwen3")
    eng = build_rollout_engine(cfg.rollout_matching, loaded, model)
    assert isinstance(eng, HFRolloutEngine)
    assert eng.metadata() == {"backend": "hf", "batch_size": 8, "cache_implementation": "static", "compile": True,
                              "compile_mode": "default", "prompt_pad_multiple": 64}
    default = build_rollout_engine(validate_config(rm_config()).rollout_matching, loaded, model)
    assert (default.cache_implementation, default.compile, default.prompt_pad_multiple) == ("dynamic", False, 1)


@pytest.mark.parametrize("hf, key, fragment", [
    ({"compile": True}, "custom.extra.rollout_matching.hf", "needs cache_implementation: static"),
    ({"cache_implementation": "paged"}, "custom.extra.rollout_matching.hf.cache_implementation", "'dynamic' or 'static'"),
    ({"compiel": True}, "custom.extra.rollout_matching.hf.compiel", "did you mean 'compile'"),
    ({"prompt_pad_multiple": 0}, "custom.extra.rollout_matching.hf.prompt_pad_multiple", "greater than"),
])
def test_hf_section_rejections_name_the_key(hf, key, fragment):
    with pytest.raises(ConfigErrors) as exc:
        validate_config(rm_config(hf=hf))
    errs = [(e.key_path, e.message) for e in exc.value.errors]
    assert any(k == key and fragment in msg for k, msg in errs), errs
