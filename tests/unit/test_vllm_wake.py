"""The sleeping engine's wake (the colocate 8B sync): vLLM's level-2 sleep saves the model's buffers to
pageable host tensors and restores each with a blocking copy on wake (the 146 pageable host-to-device copies in the
8B sync's profile); ``pin_saved_buffers`` / ``restore_pinned_buffers`` keep them in one page-locked block and write
them back with one copy. ``wake_in_background`` wakes the weights on a thread while the learner checks and merges.
The fake engine below does what vLLM's worker does at sleep and wake (save + discard, remap + restore), so the
buffers' values after a wake are what the test checks."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pytest
import torch

from trainer.rollout import vllm_compat
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin", torch.randn(16, 8))
        self.register_buffer("positions", torch.arange(7, dtype=torch.int64))
        self.register_buffer("bf16_table", torch.randn(5, 3).to(torch.bfloat16))
        self.register_buffer("strided", torch.randn(6, 4).t())  # not contiguous
        self.register_buffer("empty", torch.zeros(0))


class _Worker:
    def __init__(self):
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = _Model()
        self._sleep_saved_buffers: dict[str, torch.Tensor] = {}
        self.vllm_restored = 0


class _LLM:
    """vLLM's sleep/wake as its GPU worker does them: level 2 saves every buffer (``.cpu().clone()``) and discards
    the memory (here: overwritten); a wake of the weights restores whatever is still in ``_sleep_saved_buffers``."""

    def __init__(self, fail_wake: bool | str = False):
        self.worker = _Worker()
        self.calls: list[tuple] = []
        self.fail_wake = fail_wake

    def sleep(self, level):
        self.calls.append(("sleep", level, threading.current_thread().name))
        if level == 2:
            model = self.worker.model_runner.model
            self.worker._sleep_saved_buffers = {n: b.cpu().clone() for n, b in model.named_buffers()}
            for b in model.buffers():
                b.data.fill_(0)

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags), threading.current_thread().name))
        if self.fail_wake:
            raise RuntimeError(self.fail_wake if isinstance(self.fail_wake, str) else "cuMemCreate failed")
        if "weights" in tags:
            model = self.worker.model_runner.model
            for n, b in model.named_buffers():
                if n in self.worker._sleep_saved_buffers:
                    b.data.copy_(self.worker._sleep_saved_buffers[n])
                    self.worker.vllm_restored += 1
            self.worker._sleep_saved_buffers = {}

    def collective_rpc(self, fn, args=()):
        return [fn(_WorkerWrapper(self.worker), *args)]


class _WorkerWrapper:
    """What vLLM's ``collective_rpc`` hands a callable: ``WorkerWrapperBase``, which reads through to its worker
    (``__getattr__``) but keeps attributes set on it to itself (2026-11-27, H100: the pinned-buffer change set
    ``_sleep_saved_buffers`` on the wrapper, so vLLM still restored every buffer with a pageable copy)."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, attr):
        return getattr(self.worker, attr)


def _engine(level: int, llm: _LLM) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=level, external_launcher=True)
    engine.llm = llm
    engine._asleep = set()
    engine._weights_valid = True
    engine._waking = None
    engine._dir = Path(tempfile.mkdtemp(prefix="rm-test-wake-"))
    return engine


def _snapshot(llm: _LLM) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in llm.worker.model_runner.model.named_buffers()}


def test_level2_buffers_come_back_from_one_pinned_block_not_from_vllm():
    llm = _LLM()
    before = _snapshot(llm)
    engine = _engine(2, llm)
    engine.sleep()
    assert llm.worker._sleep_saved_buffers == {}, "vLLM's own per-buffer restore is left with nothing to copy"
    assert all(not b.any() for b in llm.worker.model_runner.model.buffers()), "the fake discarded the memory"
    block = llm.worker._rm_pinned_block
    assert block.dtype == torch.uint8 and block.numel() >= sum(t.numel() * t.element_size() for t in before.values())
    engine.wake(("weights",))
    after = _snapshot(llm)
    assert llm.worker.vllm_restored == 0
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    assert not llm.worker.model_runner.model.strided.is_contiguous()

    engine.wake()  # the KV cache: no buffers written again
    engine.sleep()
    assert llm.worker._rm_pinned_block is block, "the page-locked block is reused while the sizes hold"
    engine.wake()
    for name, value in before.items():
        assert torch.equal(llm.worker.model_runner.model.get_buffer(name), value), name


def test_level1_sleep_keeps_vllm_restore_untouched():
    llm = _LLM()
    engine = _engine(1, llm)
    engine.sleep()
    assert not hasattr(llm.worker, "_rm_pinned_block")
    assert vllm_compat.restore_pinned_buffers(llm.worker) == 0


def test_restore_names_buffers_the_woken_model_lacks():
    llm = _LLM()
    engine = _engine(2, llm)
    engine.sleep()
    llm.worker.model_runner.model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="cos_sin"):
        engine.wake(("weights",))


def test_background_wake_runs_on_a_thread_and_the_sync_waits_for_it():
    llm = _LLM()
    before = _snapshot(llm)
    engine = _engine(2, llm)
    engine.sleep()
    assert engine.wake_in_background(("weights",))
    assert not engine.wake_in_background(("weights",)), "one wake at a time"
    engine.wake(("weights",), phase_name="sync_wake")
    wakes = [c for c in llm.calls if c[0] == "wake_up"]
    assert wakes == [("wake_up", ("weights",), "rm-vllm-wake")], "woken once, on the thread"
    assert engine._asleep == {"kv_cache"}
    for name, value in before.items():
        assert torch.equal(llm.worker.model_runner.model.get_buffer(name), value), name
    engine.wake()
    assert llm.calls[-1][:2] == ("wake_up", ("kv_cache",))
    assert not engine.wake_in_background(("weights",)), "nothing asleep: nothing started"


def test_background_wake_error_is_raised_where_the_engine_is_next_used():
    llm = _LLM(fail_wake=True)
    engine = _engine(2, llm)
    engine.sleep()
    engine.wake_in_background(("weights",))
    with pytest.raises(RuntimeError, match="cuMemCreate failed") as raised:
        engine.wake(("weights",))
    assert type(raised.value) is RuntimeError, "the wake's own error, as the synchronous wake would raise it"
    assert "weights" in engine._asleep and engine._waking is None


CUMEM_OOM = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"


@pytest.mark.parametrize("background", [False, True])
def test_an_allocator_out_of_memory_at_the_wake_is_torch_s_out_of_memory_error_in_the_wake_phase(background):
    """What vLLM 0.26 raised on the H100 (2026-11-26) when a 2B full fine-tune without checkpointing left too little
    for the KV cache: a RuntimeError from its allocator, which the step's out-of-memory handling did not catch."""
    from trainer.telemetry import PhaseTimers

    engine = _engine(2, _LLM(fail_wake=CUMEM_OOM))
    engine._asleep = {"weights", "kv_cache"}
    timers = PhaseTimers(memory=None)
    with timers.bound(), pytest.raises(torch.OutOfMemoryError) as info:
        if background:
            assert engine.wake_in_background(("weights",))
            engine.wake(("weights",), phase_name="sync_wake")
        else:
            engine.wake()
    text = str(info.value)
    assert "could not map its " + ("weights" if background else "weights + kv_cache") + " back (" + CUMEM_OOM in text
    assert "custom.extra.rollout_matching.vllm.gpu_memory_utilization=0.45" in text
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == CUMEM_OOM
    assert timers.out_of_memory_in == ("sync_wake" if background else "wake")
    assert engine._asleep == {"weights", "kv_cache"}, "nothing woke"


def test_the_wake_hands_torch_s_cached_blocks_back_before_vllm_maps_its_pool(monkeypatch):
    """vLLM 0.26's cumem ``wake_up`` maps the pool without emptying torch's cache (0.32's does): the blocks the
    learner's backward left cached must be released first, or the KV cache cannot be mapped back."""
    llm = _LLM()
    engine = _engine(2, llm)
    engine.sleep()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 << 30, 80 << 30))
    monkeypatch.setattr(vllm_compat, "restore_pinned_buffers", lambda worker: 0)
    monkeypatch.setattr(vllm_compat, "sleeping_bytes", lambda tags: 12 << 30)
    engine.wake()
    names = [c[0] for c in llm.calls]
    assert names[-2:] == ["empty_cache", "wake_up"], names


@pytest.mark.parametrize("need_gib, free_gib, released", [(12, 10, True), (9.5, 10, True), (8, 10, False),
                                                          (None, 70, True)])
def test_the_wake_releases_torch_s_cache_only_when_the_free_memory_does_not_cover_the_pool(
        monkeypatch, need_gib, free_gib, released):
    """Free memory >= what the wake maps + 1 GiB: the learner keeps its cached blocks; an allocator that does not
    say how much it maps (None) gets the release."""
    llm = _LLM()
    engine = _engine(2, llm)
    engine.sleep()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free_gib * 2**30), 80 << 30))
    monkeypatch.setattr(vllm_compat, "restore_pinned_buffers", lambda worker: 0)
    asked = []
    monkeypatch.setattr(vllm_compat, "sleeping_bytes",
                        lambda tags: asked.append(tuple(tags)) or (None if need_gib is None else int(need_gib * 2**30)))
    engine.wake()
    assert ("empty_cache",) in llm.calls if released else ("empty_cache",) not in llm.calls
    assert asked == [("weights", "kv_cache")] and llm.calls[-1][0] == "wake_up"


def test_sleeping_bytes_sums_the_sleeping_allocations_of_the_tags(monkeypatch):
    from vllm.device_allocator.cumem import AllocationData, CuMemAllocator

    class _Alloc:
        pointer_to_data = {1: AllocationData((0, 4 << 20, 1, 0), "weights", is_asleep=True),
                           2: AllocationData((0, 6 << 20, 2, 0), "kv_cache", is_asleep=True),
                           3: AllocationData((0, 8 << 20, 3, 0), "weights", is_asleep=False)}

    monkeypatch.setattr(CuMemAllocator, "get_instance", staticmethod(lambda: _Alloc()))
    assert vllm_compat.sleeping_bytes(["weights"]) == 4 << 20
    assert vllm_compat.sleeping_bytes(["weights", "kv_cache"]) == 10 << 20
    monkeypatch.setattr(CuMemAllocator, "get_instance", staticmethod(lambda: (_ for _ in ()).throw(AssertionError())))
    assert vllm_compat.sleeping_bytes(["weights"]) is None


def test_sleep_waits_for_a_background_wake_first():
    llm = _LLM()
    engine = _engine(2, llm)
    engine.sleep()
    engine.wake_in_background(("weights",))
    engine.wake()  # the rest; then sleep again
    engine.sleep()
    kinds = [c[:2] for c in llm.calls]
    assert kinds == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 2)]


class _Target:
    syncs_on_every_rank = True

    def __init__(self, calls, fail=False):
        self.calls = calls
        self.fail = fail

    def supports_adapter_sync(self):
        return False

    def begin_sync(self):
        self.calls.append("begin")

    def end_sync(self):
        self.calls.append("end")

    def sync_full(self, model, merge_adapter=True):
        self.calls.append("full")
        if self.fail:
            raise RuntimeError("push failed")

    def sync_adapter(self, model):
        self.calls.append("adapter")


def test_sync_begins_before_the_learner_check_and_always_ends(monkeypatch):
    from trainer.sync import policy

    calls: list[str] = []
    monkeypatch.setattr(policy, "check_learner_weights", lambda *a, **k: calls.append("check"))
    sync = policy.WeightSync(_Target(calls), policy.resolve_sync_mode("full", None, False, True))
    assert sync.ensure_fresh(torch.nn.Linear(2, 2), 0)
    assert calls == ["begin", "check", "full", "end"], "the engine starts waking before the learner's check"
    calls.clear()
    failing = policy.WeightSync(_Target(calls, fail=True), policy.resolve_sync_mode("full", None, False, True))
    with pytest.raises(RuntimeError, match="push failed"):
        failing.ensure_fresh(torch.nn.Linear(2, 2), 1)
    assert calls == ["begin", "check", "full", "end"], "a failed sync still ends (server mode: the lock is released)"
    assert failing.last_step is None


def test_tp_all_reduce_stays_off_multicast_paths_when_multicast_is_off():
    env, kwargs = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, {}
    assert vllm_compat.all_reduce_without_multicast(kwargs, env) == ["VLLM_ALLREDUCE_USE_SYMM_MEM", "fuse_allreduce_rms"]
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert kwargs == {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    env = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "1"}
    kwargs = {"compilation_config": {"mode": 0}}
    assert vllm_compat.all_reduce_without_multicast(kwargs, env) == [], "the user's own settings win"
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "1" and kwargs == {"compilation_config": {"mode": 0}}
    kwargs = {}
    assert vllm_compat.all_reduce_without_multicast(kwargs, {}) == [] and kwargs == {}, "multicast on: vLLM decides"


def test_disable_custom_all_reduce_reaches_the_engine_kwargs(monkeypatch):
    from trainer.config.schema import validate_config
    from trainer.rollout import vllm_colocate

    seen = {}
    monkeypatch.setattr(vllm_colocate, "VllmColocateEngine", lambda *a, **k: seen.update(k))
    from trainer.modeling.fixtures import tiny_tokenizer

    loaded = type("Loaded", (), {"model_dir": "unused", "tokenizer": tiny_tokenizer()})()
    for flags, kwargs in (({"disable_custom_all_reduce": True, "enforce_eager": True},
                           {"disable_custom_all_reduce": True, "enforce_eager": True}),
                          ({}, None)):
        cfg = validate_config({"model": {"path": "unused"}, "data": {"synthetic": {"num_samples": 2}},
                               "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "vllm": {"max_model_len": 4096, **flags}}}}})
        seen.clear()
        vllm_colocate.engine_from_config(cfg.custom.extra.rollout_matching, loaded, torch.nn.Linear(2, 2))
        assert seen["engine_kwargs"] == kwargs
