"""The colocated vLLM engine on CPU against the HF model: same greedy ids, and weight sync (full and
LoRA adapter) makes vLLM decode exactly as the HF model with the same weights."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams, RolloutRequest, check_prompt_alignment

pytestmark = pytest.mark.vllm

PARAMS = DecodingParams(max_new_tokens=16)
SCENES = ["red circle top left", "two blue squares", "a green triangle near the bottom edge", "empty"]


def hf_decode(model, tok, stop_ids, requests):
    return HFRolloutEngine(model, tok.pad_token_id, stop_ids, batch_size=1).generate(requests, PARAMS)


@pytest.fixture(scope="module")
def hf_model(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_text_dir, stop_ids, cpu_engine_kwargs):
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    t0 = time.perf_counter()
    eng = VllmColocateEngine(tiny_text_dir, stop_ids, max_model_len=256, gpu_memory_utilization=0.3,
                             enable_lora=True, max_lora_rank=8, dtype="float32", engine_kwargs=cpu_engine_kwargs)
    print(f"vLLM colocate engine start-up: {time.perf_counter() - t0:.1f}s")
    yield eng
    eng.close()


def test_greedy_matches_hf_and_prompt_aligns(engine, hf_model, tiny_tok, stop_ids, chat_requests):
    reqs = chat_requests(tiny_tok, SCENES)
    got = engine.generate(reqs, PARAMS)
    check_prompt_alignment(reqs, got)
    want = hf_decode(hf_model, tiny_tok, stop_ids, reqs)
    assert [r.response_token_ids for r in got] == [r.response_token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert engine.generate([], PARAMS) == []


def test_request_longer_than_max_model_len_fails_with_the_key(engine, tiny_tok):
    long = RolloutRequest("too-long", ({"role": "user", "content": "x"},), tuple([5] * 250))
    with pytest.raises(ValueError, match=r"too-long.*max_model_len=256"):
        engine.generate([long], PARAMS)


def test_full_sync_makes_vllm_decode_like_the_new_weights(engine, hf_model, tiny_tok, stop_ids, chat_requests):
    reqs = chat_requests(tiny_tok, SCENES)
    before = [r.response_token_ids for r in engine.generate(reqs, PARAMS)]
    learner = copy.deepcopy(hf_model)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    want = [r.response_token_ids for r in hf_decode(learner, tiny_tok, stop_ids, reqs)]
    assert want != before, "perturbation too small to change greedy outputs"
    t0 = time.perf_counter()
    engine.sync_full(learner)
    print(f"full sync: {time.perf_counter() - t0:.2f}s")
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == want
    engine.sync_full(hf_model)
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == before


def test_adapter_sync_on_step_boundaries(engine, hf_model, tiny_tok, stop_ids, chat_requests):
    from peft import LoraConfig, get_peft_model

    from trainer.sync.policy import WeightSync

    reqs = chat_requests(tiny_tok, SCENES)
    base_out = [r.response_token_ids for r in engine.generate(reqs, PARAMS)]
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                                    init_lora_weights=False))
    sync = WeightSync.for_model(engine, peft_model, "auto")
    assert sync.decision.mode == "adapter"
    assert sync.ensure_fresh(peft_model, 0)
    want0 = [r.response_token_ids for r in hf_decode(peft_model, tiny_tok, stop_ids, reqs)]
    assert want0 != base_out
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == want0

    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    want1 = [r.response_token_ids for r in hf_decode(peft_model, tiny_tok, stop_ids, reqs)]
    assert want1 != want0
    assert not sync.ensure_fresh(peft_model, 0), "a second call within the same optimizer step must not sync"
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == want0
    assert sync.ensure_fresh(peft_model, 1)
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == want1
    assert sync.history == [(0, "base+adapter"), (1, "adapter")]
    engine.sync_full(hf_model)
    assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == base_out


def test_recorded_load_on_cpu_keeps_vllm_s_loader(engine, hf_model, tiny_tok, stop_ids, chat_requests):
    """``vllm.sync.recorded_load`` on vLLM's CPU build: its loader re-runs the CPU kernels' weight repacking after
    every load (layerwise reload), which a replay of copies cannot repeat, so every sync keeps going through vLLM's
    loader and the engine decodes like the learner. The replay itself is checked against vLLM's loader on a GPU
    (``tests/gpu/test_vllm_gpu.py::test_recorded_load_replays_vllm_s_loader``) and on a loader shaped like vLLM's
    in ``tests/unit/test_load_plan.py``."""
    from dataclasses import replace

    from trainer.rollout.vllm_compat import inner_worker, needs_layerwise_reload

    plain = engine.vllm.settings
    reqs = chat_requests(tiny_tok, SCENES)
    learner = copy.deepcopy(hf_model)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    try:
        engine.vllm.settings = replace(plain, recorded_load=True)
        for _ in range(2):
            engine.sync_full(learner)
            worker = engine.vllm.llm.collective_rpc(lambda w: inner_worker(w))[0]
            assert needs_layerwise_reload(worker) and worker._rm_load_path == "loader"
            assert getattr(worker, "_rm_load_plan", None) is None
        assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == \
            [r.response_token_ids for r in hf_decode(learner, tiny_tok, stop_ids, reqs)]
    finally:
        engine.vllm.settings = plain
        engine.sync_full(hf_model)
