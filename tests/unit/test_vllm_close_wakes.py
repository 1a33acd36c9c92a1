"""A sleeping in-process vLLM engine is woken before it is closed. On a GPU, vLLM's sleep-mode allocator (cumem)
keeps a process-wide error once sleeping (unmapped) memory is freed, and every later sleep-mode engine in the same
process then fails to allocate (seen on the H100: the second stage-2 colocate run in one process died with
"CUDA out of memory. Tried to allocate 2.00 MiB" and 78 GiB free). vLLM's CPU backend cannot sleep, so the order of
calls is what this test can check here; the GPU test runs two sleep-mode trainings in one process."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings


class _Core:
    def __init__(self, calls):
        self.calls = calls

    def shutdown(self):
        self.calls.append(("shutdown",))


class _LLM:
    def __init__(self, calls):
        self.calls = calls
        self.llm_engine = type("Engine", (), {"engine_core": _Core(calls)})()

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, fn, args=()):
        return [0]


def _engine(level: int, calls: list) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=level, external_launcher=True)
    engine.llm = _LLM(calls)
    engine._asleep = set()
    engine._weights_valid = True
    engine._waking = None
    engine._dir = Path(tempfile.mkdtemp(prefix="rm-test-close-"))
    return engine


def test_close_wakes_a_sleeping_engine_before_shutting_it_down():
    for level in (1, 2):
        calls: list = []
        engine = _engine(level, calls)
        engine.sleep()
        engine.close()
        assert calls == [("sleep", level), ("wake_up", ("weights", "kv_cache")), ("shutdown",)], calls
        assert engine.llm is None and not engine._dir.exists()


def test_close_of_an_awake_engine_does_not_wake_it():
    calls: list = []
    engine = _engine(1, calls)
    engine.sleep()
    engine.wake()
    engine.close()
    assert calls == [("sleep", 1), ("wake_up", ("weights", "kv_cache")), ("shutdown",)], calls
