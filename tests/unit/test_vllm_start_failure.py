"""Why an in-process vLLM engine failed to start (``explain_start_failure``), and the refusal of a second sleep-mode
engine in one process before vLLM is called (vLLM's sleep-mode allocator, CuMemAllocator, is one per process)."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout import vllm_inprocess
from trainer.rollout.vllm_inprocess import (
    InProcessVllm,
    VllmEngineError,
    VllmSettings,
    check_sleep_engine_slot,
    explain_start_failure,
)

KEY = "custom.extra.rollout_matching.vllm"


def _settings(level: int = 1, **kw) -> VllmSettings:
    return VllmSettings(model_dir="/models/policy", max_model_len=4096, gpu_memory_utilization=0.4,
                        sleep_level=level, **kw)


def _raised(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` as if raised ``from inner`` (as vLLM's engine-core start wraps the worker's error)."""
    outer.__cause__ = inner
    return outer


CUMEM = AssertionError("CuMem allocator can only be used for one instance per process.")


def test_cumem_one_instance_names_the_allocator_and_says_what_to_do():
    msg = explain_start_failure(CUMEM, _settings(), 1)
    assert "sleep-mode allocator (CuMemAllocator) is one per process" in msg
    assert "this process already started 1 sleep-mode engine(s)" in msg
    assert "its own process" in msg and f"{KEY}.sleep_level 0" in msg
    assert "gpu_memory_utilization" not in msg and "AssertionError: CuMem allocator" in msg


def test_cumem_found_behind_the_engine_core_wrapper():
    wrapped = _raised(RuntimeError("Engine core initialization failed. See root cause above."), CUMEM)
    msg = explain_start_failure(wrapped, _settings(), 0)
    assert "one per process" in msg and "still in its pool" in msg
    assert "RuntimeError: Engine core initialization failed" in msg


def test_any_failure_of_a_second_sleep_mode_engine_is_the_allocator():
    """cumem's sticky error after an earlier engine reads as a tiny CUDA OOM with most of the GPU free."""
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    assert "one per process" in explain_start_failure(oom, _settings(level=2), 1)
    assert "one per process" not in explain_start_failure(oom, _settings(level=0), 1)


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"),
    ValueError("Free memory on device cuda:0 (10.0/79.2 GiB) on startup is less than desired GPU memory utilization"),
    _raised(RuntimeError("Engine core initialization failed."), RuntimeError("CUDA out of memory.")),
], ids=["cuda-oom", "no-kv-cache", "free-memory", "wrapped-oom"])
def test_out_of_memory_gets_the_memory_advice(exc):
    msg = explain_start_failure(exc, _settings(), 0)
    assert msg.startswith("vLLM ran out of GPU memory while starting for /models/policy")
    assert f"{KEY}.gpu_memory_utilization (now 0.4)" in msg and f"{KEY}.max_model_len (now 4096)" in msg
    assert "one per process" not in msg


def test_other_failures_are_named_neutrally():
    exc = OSError("/models/policy does not appear to have a file named config.json")
    msg = explain_start_failure(exc, _settings(level=0, engine_kwargs={"enforce_eager": True}), 0)
    assert "OSError: /models/policy does not appear" in msg
    assert "Check the model directory" in msg and f"{KEY}.max_model_len=4096" in msg
    assert "engine_kwargs=['enforce_eager']" in msg
    assert "ran out of" not in msg and "one per process" not in msg


def test_slot_check_refuses_a_second_sleep_mode_engine_only():
    check_sleep_engine_slot(_settings(level=1), started=0)
    check_sleep_engine_slot(_settings(level=0), started=3)
    with pytest.raises(VllmEngineError, match="not starting a second sleep-mode vLLM engine") as err:
        check_sleep_engine_slot(_settings(level=2), started=1)
    assert "one per process" in str(err.value) and f"{KEY}.sleep_level 0" in str(err.value)


def test_second_sleep_mode_engine_fails_before_vllm_is_called(monkeypatch):
    """The count is this module's; the check runs before vLLM is imported or the engine's scratch dir is made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_inprocess, "_sleep_engines_started", 1)
    monkeypatch.setattr(vllm_inprocess.tempfile, "mkdtemp", lambda **_: pytest.fail("got past the check"))
    assert vllm_inprocess.sleep_engines_started() == 1
    with pytest.raises(VllmEngineError, match="this process already started 1 sleep-mode engine"):
        InProcessVllm(_settings(level=1))


def test_start_counts_sleep_mode_engines_and_explains_the_failure(monkeypatch):
    """A sleep-mode start counts (also when vLLM then fails: its pool may hold memory); a plain one does not."""
    import sys
    import types

    calls = []

    def failing_llm(**kwargs):
        calls.append(kwargs)
        raise CUMEM

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=failing_llm))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_inprocess.vllm_compat, "run_engine_in_process", lambda: None)
    monkeypatch.setattr(vllm_inprocess, "_sleep_engines_started", 0)
    with pytest.raises(VllmEngineError, match="CuMemAllocator"):
        InProcessVllm(_settings(level=0))
    assert vllm_inprocess.sleep_engines_started() == 0
    with pytest.raises(VllmEngineError, match="still in its pool"):
        InProcessVllm(_settings(level=1))
    assert vllm_inprocess.sleep_engines_started() == 1 and calls[-1]["enable_sleep_mode"] is True
    with pytest.raises(VllmEngineError, match="not starting a second"):
        InProcessVllm(_settings(level=2))
    assert len(calls) == 2
