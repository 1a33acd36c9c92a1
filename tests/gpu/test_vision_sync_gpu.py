"""A vision-language engine decodes as the learner after a sync: every ``model.visual.*`` weight of a tiny Qwen3-VL
is changed and synced into the colocated vLLM engine on a GPU (vLLM's CPU build cannot load Qwen3-VL without
torchvision, which the CPU torch cannot import); its greedy output on image prompts then
equals the learner's, and its log-probabilities differ from the learner's before the sync (the stale tower: the
train-inference mismatch of ``trainer.sft.mismatch``) and agree after. A random tiny model's greedy tokens barely
depend on the image, so the log-probabilities, not the tokens, show the tower's change."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.fixtures import build_tiny_image_processor, save_tiny_model, tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.modeling.tokenizer import IMAGE_PAD
from trainer.rollout.codec import RolloutCodec
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams
from trainer.sft.mismatch import MismatchStats, summary

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM (the vllm extra)")]

GREEDY = DecodingParams(max_new_tokens=12, logprobs=0)


def learner_logprobs(model, requests, results, image_token_id):
    """The learner's log-probability of each token the engine decoded (teacher-forced, images included)."""
    out = []
    for req, res in zip(requests, results):
        ids = torch.tensor([list(req.prompt_token_ids) + list(res.response_token_ids)]).cuda()
        mm = {k: v.cuda() for k, v in req.mm_inputs.items()}
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                           mm_token_type_ids=(ids == image_token_id).long()).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        n = len(req.prompt_token_ids)
        out.append(torch.stack([lp[n + i - 1, t] for i, t in enumerate(res.response_token_ids)]).cpu())
    return out


def gap(model, requests, results, image_token_id):
    stats = MismatchStats()
    for learner, res in zip(learner_logprobs(model, requests, results, image_token_id), results):
        stats.add(MismatchStats.of(learner, torch.tensor([d[t] for d, t in zip(res.logprobs, res.response_token_ids)])))
    return summary(*stats.totals())


def test_a_synced_vision_tower_decodes_as_the_learner(tmp_path):
    from transformers import AutoModelForImageTextToText

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    model_dir = save_tiny_model(tmp_path / "vl", "vl", seed=0)
    tok = tiny_tokenizer()
    stops = sorted(stop_token_ids(tok))
    image_token = tok.convert_tokens_to_ids(IMAGE_PAD)
    samples = load_jsonl(generate(tmp_path / "data", 4, seed=3, max_objects=3))
    requests = RolloutCodec(PromptEncoder(tok, build_tiny_image_processor())).requests(samples)[0]
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().cuda()
    learner = copy.deepcopy(base)
    torch.manual_seed(11)
    with torch.no_grad():
        changed = [p.add_(torch.randn_like(p) * 0.5 * (p.std() if p.numel() > 1 else 1.0))
                   for n, p in learner.named_parameters() if ".visual." in f".{n}"]
    assert changed, "the tiny model has a vision tower"
    want = [r.response_token_ids for r in HFRolloutEngine(learner, tok.pad_token_id, stops, 1,
                                                          image_token).generate(requests, GREEDY)]
    engine = VllmColocateEngine(model_dir, stops, max_model_len=512, gpu_memory_utilization=0.3, dtype="float32",
                                engine_kwargs={"enforce_eager": True})
    try:
        before = engine.generate(requests, GREEDY)
        stale = gap(learner, requests, before, image_token)
        engine.sync_full(learner)
        after = engine.generate(requests, GREEDY)
        assert [r.response_token_ids for r in after] == want
        fresh = gap(learner, requests, after, image_token)
    finally:
        engine.close()
    assert fresh["mismatch/logp_abs_diff_mean"] < 1e-3, fresh
    assert stale["mismatch/logp_abs_diff_mean"] > 100 * max(fresh["mismatch/logp_abs_diff_mean"], 1e-5), (stale, fresh)
