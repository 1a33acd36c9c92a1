"""``vllm.sleep_level: kv_cache`` (the colocate 8B sync): between decodes the engine releases its KV cache
alone and keeps the weights mapped, so a weight sync wakes nothing and loads into live parameters, and the decode maps
the KV cache back through vLLM's worker ``wake_up(tags=["kv_cache"])``. The fake below is vLLM 0.26's sleep-mode
allocator record (``AllocationData`` per allocation, its real class) and a worker whose ``wake_up`` maps the tags it
is asked for, as ``CuMemAllocator.wake_up`` does; the checks are which allocations are mapped after each call."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config.vllm import VllmConfig
from trainer.memory.oom import MemorySettings, advice
from trainer.rollout import vllm_compat
from trainer.rollout.vllm_inprocess import KV_CACHE_ONLY, InProcessVllm, VllmSettings

cumem = pytest.importorskip("vllm.device_allocator.cumem", reason="vLLM's sleep-mode allocator module is not installed")


class _Allocator:
    def __init__(self):
        self.pointer_to_data = {1: cumem.AllocationData((0, 4 << 20, 1, 0), "weights"),
                                2: cumem.AllocationData((0, 6 << 20, 2, 0), "kv_cache"),
                                3: cumem.AllocationData((0, 8 << 20, 3, 0), "weights"),
                                4: cumem.AllocationData((0, 2 << 20, 4, 0), "kv_cache")}

    def mapped(self, tag: str) -> list[bool]:
        return [not d.is_asleep for d in self.pointer_to_data.values() if d.tag == tag]


class _Worker:
    def __init__(self, allocator: _Allocator):
        self.allocator = allocator
        self.woken: list[list[str]] = []

    def wake_up(self, tags=None):
        self.woken.append(list(tags))
        for d in self.allocator.pointer_to_data.values():
            if tags is None or d.tag in tags:
                d.is_asleep = False


class _Wrapper:
    """vLLM's ``WorkerWrapperBase``: reads through to its worker."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, attr):
        return getattr(self.worker, attr)


class _LLM:
    def __init__(self, worker: _Worker):
        self.worker = worker
        self.calls: list[tuple] = []
        self.llm_engine = type("Engine", (), {"reset_encoder_cache": lambda _: self.calls.append(
            ("reset_encoder_cache",))})()

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn, args=()):
        return [fn(_Wrapper(self.worker), *args)]


@pytest.fixture
def allocator(monkeypatch):
    alloc = _Allocator()
    released: list[int] = []

    def unmap_and_release(handle):
        released.append(handle[2])

    monkeypatch.setattr(cumem.CuMemAllocator, "get_instance", staticmethod(lambda: alloc))
    monkeypatch.setattr(cumem, "unmap_and_release", unmap_and_release)
    alloc.released = released
    return alloc


def _engine(llm: _LLM) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=KV_CACHE_ONLY,
                                   external_launcher=True)
    engine.llm = llm
    engine._asleep = set()
    engine._weights_valid = True
    engine._caches_stale = False
    engine._waking = None
    engine._dir = Path(tempfile.mkdtemp(prefix="rm-test-kv-sleep-"))
    return engine


def test_kv_cache_sleep_releases_the_kv_cache_and_keeps_the_weights_mapped(allocator):
    worker = _Worker(allocator)
    llm = _LLM(worker)
    engine = _engine(llm)
    engine.sleep()
    assert allocator.released == [2, 4], "only the KV-cache allocations are unmapped"
    assert allocator.mapped("weights") == [True, True] and allocator.mapped("kv_cache") == [False, False]
    assert ("sleep", 2) not in llm.calls and not any(c[0] == "sleep" for c in llm.calls), "vLLM's sleep unmaps all"
    assert engine._asleep == {"kv_cache"} and engine._weights_valid and engine._caches_stale
    assert vllm_compat.sleeping_bytes(["weights"]) == 0 and vllm_compat.sleeping_bytes(["kv_cache"]) == 8 << 20

    engine.wake(("weights",), phase_name="sync_wake")  # what a weight sync asks for: nothing sleeps there
    assert worker.woken == [] and llm.calls == []

    engine.sleep()  # already asleep: nothing released twice
    assert allocator.released == [2, 4]

    engine.wake()
    assert worker.woken == [["kv_cache"]], "vLLM's own worker maps the KV cache back (on the wrapped worker)"
    assert allocator.mapped("kv_cache") == [True, True] and not engine._asleep
    assert not any(c[0] == "wake_up" for c in llm.calls), "the engine-level wake would refuse: vLLM never slept"

    engine.sleep()
    assert allocator.released == [2, 4, 2, 4] and allocator.mapped("weights") == [True, True]


def test_a_decode_after_a_kv_cache_sleep_resets_the_prefix_cache_first(allocator):
    llm = _LLM(_Worker(allocator))
    engine = _engine(llm)
    engine.weights_source = None
    engine.sleep()
    engine._ready()
    assert llm.calls == [("reset_prefix_cache",), ("reset_encoder_cache",)], \
        "cached prefixes pointed into the released KV cache"
    assert not engine._caches_stale and allocator.mapped("kv_cache") == [True, True]


def test_kv_cache_is_a_sleep_level_of_the_config_and_a_typo_is_refused():
    assert VllmConfig(sleep_level="kv_cache").sleep_level == "kv_cache"
    assert VllmConfig(sleep_level=2).sleep_level == 2
    with pytest.raises(ValidationError, match="sleep_level"):
        VllmConfig(sleep_level="kv")


def test_oom_advice_names_the_weights_the_kv_cache_sleep_keeps():
    s = MemorySettings(tuner="lora", packing=True, packing_length=16384, checkpointing="full",
                       gpu_memory_utilization=0.35, sleep_level="kv_cache")
    for phase_name in ("backward", "optimizer"):
        joined = "\n".join(advice(phase_name, s))
        assert "vllm.sleep_level: 2 (now kv_cache)" in joined, (phase_name, joined)
    assert "now kv_cache" not in "\n".join(advice("backward", MemorySettings(sleep_level=2)))
