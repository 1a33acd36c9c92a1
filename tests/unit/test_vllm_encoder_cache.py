"""After a weight update the engine's cached image embeddings go, on the scheduler's side and the worker's together.

vLLM keeps two halves of its encoder cache: the scheduler's record of which image hashes are cached (it then sends a
request without asking for the encoder) and the worker's store of the embeddings. Resetting only the worker's store
(what the sync did before) left the scheduler's record, and the next request with the same image, such as the eval
set decoded again after a stage-2 step, failed with "Encoder cache miss" (H200, vLLM 0.26, 2026-11-28). The fake
below keeps the two halves as vLLM does, so resetting one alone fails the same way."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from trainer.rollout import vllm_compat
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings


class _Runner:
    def __init__(self):
        self.encoder_store: dict[str, tuple[str, int]] = {}
        self.lora_resets = 0

    def reset_encoder_cache(self):
        self.encoder_store.clear()

    def reset_mm_cache(self):
        raise AssertionError("processed images do not depend on the weights: the mm cache is left alone")

    def reset_lora_state(self):
        self.lora_resets += 1


class _Worker:
    def __init__(self):
        self.model_runner = _Runner()


class _Engine:
    """``LLMEngine``: the scheduler's record of cached images; ``reset_encoder_cache`` clears both halves."""

    def __init__(self, worker: _Worker):
        self.worker = worker
        self.scheduled: set[str] = set()

    def reset_encoder_cache(self):
        self.scheduled.clear()
        self.worker.model_runner.reset_encoder_cache()


class _LLM:
    def __init__(self):
        self.worker = _Worker()
        self.llm_engine = _Engine(self.worker)
        self.weights_version = 0
        self.prefix_resets = 0

    def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=False):
        store = self.worker.model_runner.encoder_store
        embeddings = []
        for p in prompts:
            for image in p.get("multi_modal_data", {}).get("image", []):
                if image in self.llm_engine.scheduled:
                    if image not in store:
                        raise RuntimeError(f"Encoder cache miss for {image}.")
                else:
                    store[image] = (image, self.weights_version)
                    self.llm_engine.scheduled.add(image)
                embeddings.append(store[image])
        return embeddings

    def load_new_weights(self):
        """What a sync does in the worker (``vllm_compat.load_checkpoint_tensors`` ends in ``reset_derived_state``)."""
        self.weights_version += 1
        vllm_compat.reset_derived_state(self.worker)


def _engine(llm: _LLM) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=0, external_launcher=True)
    engine.llm = llm
    engine._asleep = set()
    engine._weights_valid = True
    engine._caches_stale = False
    engine._waking = None
    engine.lora_request = None
    engine._dir = Path(tempfile.mkdtemp(prefix="rm-test-encoder-"))
    return engine


def _decode(engine: InProcessVllm, images: list[str]):
    engine._ready()
    return engine.llm.generate([{"prompt_token_ids": [1], "multi_modal_data": {"image": [i]}} for i in images], None)


def test_the_same_images_decoded_after_a_sync_are_encoded_again_with_the_new_weights():
    llm = _LLM()
    engine = _engine(llm)
    assert [v for _, v in _decode(engine, ["eval-a", "eval-b"])] == [0, 0]
    llm.load_new_weights()
    engine._caches_stale = True  # every load path marks it (load_weights, load_unmerged, load_adapter, drop_adapter)
    assert [v for _, v in _decode(engine, ["eval-a", "eval-b"])] == [1, 1], "no embedding from the old weights"
    assert llm.prefix_resets == 1 and llm.worker.model_runner.lora_resets == 1


def test_a_worker_only_reset_is_the_failure_the_fake_reproduces():
    llm = _LLM()
    engine = _engine(llm)
    _decode(engine, ["eval-a"])
    llm.worker.model_runner.reset_encoder_cache()
    with pytest.raises(RuntimeError, match="Encoder cache miss"):
        llm.generate([{"prompt_token_ids": [1], "multi_modal_data": {"image": ["eval-a"]}}], None)


def test_the_servers_reset_drops_both_caches_now_or_at_the_next_decode_when_asleep():
    llm = _LLM()
    engine = _engine(llm)
    _decode(engine, ["x"])
    assert engine.reset_prefix_cache() is True
    assert llm.llm_engine.scheduled == set() and llm.worker.model_runner.encoder_store == {}
    _decode(engine, ["x"])
    engine._asleep = {"weights"}
    engine.reset_prefix_cache()
    assert llm.llm_engine.scheduled == {"x"} and engine._caches_stale, "asleep: deferred to the next decode"


def test_a_release_without_the_engine_level_reset_still_drops_the_prefix_cache():
    class Old:
        llm_engine = object()

        def reset_prefix_cache(self):
            return False

    assert vllm_compat.reset_weight_caches(Old()) is False
