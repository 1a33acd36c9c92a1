"""Which engine failures the rollout server treats as a dead engine (503, exit 75) and which as recoverable."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trainer.server.fatal import EXIT_ENGINE_DEAD, FatalEngineError, dead_detail, fatal_engine_error


class EngineDeadError(Exception):
    """Stands in for ``vllm.v1.engine.exceptions.EngineDeadError`` (matched by name: vLLM is not imported)."""


class VllmSubclassOfDead(EngineDeadError):
    pass


def _caused(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("exc", [
    EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause."),
    VllmSubclassOfDead("engine core gone"),
    FatalEngineError("scripted engine died"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:235"),
    _caused(RuntimeError("vLLM could not decode"), EngineDeadError("EngineCore encountered an issue.")),
    _caused(ValueError("wrapped"), RuntimeError("CUDA error: misaligned address")),
    _caused(EngineDeadError("dead"), torch.OutOfMemoryError("CUDA out of memory")),
], ids=["engine-dead", "engine-dead-subclass", "fatal-engine-error", "illegal-access", "device-assert",
        "launch-failure", "cumem-invalid-argument", "dead-as-cause", "cuda-as-cause", "dead-after-oom"])
def test_fatal(exc):
    reason = fatal_engine_error(exc)
    assert reason is not None and len(reason) <= 1000


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),
    _caused(RuntimeError("vLLM ran out of memory while decoding 8 requests"),
            torch.OutOfMemoryError("CUDA out of memory")),
    ValueError("prompt of 5000 tokens + 256 new tokens exceeds max_model_len 4096"),
    RuntimeError("an earlier background weight-update call failed: ConnectionError()"),
    KeyError("model.layers.0.weight"),
], ids=["torch-oom", "cuda-error-oom", "wrapped-oom", "request-error", "nccl-failure", "key-error"])
def test_recoverable(exc):
    assert fatal_engine_error(exc) is None


def test_reason_is_bounded_and_detail_says_what_happens():
    reason = fatal_engine_error(RuntimeError("CUDA error: an illegal memory access was encountered" + "x" * 5000))
    assert reason is not None and len(reason) == 1000
    detail = dead_detail("vllm", "EngineDeadError: gone")
    assert "vllm engine is dead (EngineDeadError: gone)" in detail
    assert f"exiting (code {EXIT_ENGINE_DEAD})" in detail and "restarted" in detail and EXIT_ENGINE_DEAD == 75


def test_vllm_still_names_its_dead_engine_error_so():
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "v1" / "engine" / "exceptions.py").read_text()
    assert "class EngineDeadError(" in source


def test_server_supervisor_names_the_engine_death_exit_code():
    from trainer.deploy.lifecycle import server_exit_reason

    assert "its engine died" in server_exit_reason(EXIT_ENGINE_DEAD) and "re-admits" in server_exit_reason(75)
    assert server_exit_reason(1) == "" and server_exit_reason(0) == ""
