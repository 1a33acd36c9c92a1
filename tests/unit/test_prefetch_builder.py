"""``RolloutPrefetcher.issue`` with a request builder: the engine builds the requests in its background thread (off
the learner's critical path) and ``take`` hands them back with the results; plain request lists keep working."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from trainer.rollout.prefetch import RolloutPrefetcher
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult


class Engine:
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.built_in: list[str] = []

    def _decode(self, requests):
        return [RolloutResult(r.sample_id, r.prompt_token_ids, (7,), "stop") for r in requests]

    def generate_async(self, requests, params) -> Future:
        return self.pool.submit(self._decode, list(requests))

    def generate_async_built(self, build, params) -> Future:
        def run():
            self.built_in.append(threading.current_thread().name)
            requests = list(build())
            return requests, self._decode(requests)

        return self.pool.submit(run)


def _requests(ids):
    return [RolloutRequest(i, (), (1, 2)) for i in ids]


def test_builder_runs_in_the_engine_thread_and_take_returns_its_requests():
    engine = Engine()
    pre = RolloutPrefetcher(engine, max_staleness_steps=1)
    params = DecodingParams(8)
    assert pre.issue(lambda: _requests(["a", "b"]), params, version=0, step=1, sample_ids=["a", "b"])
    results, version, requests = pre.take(["a", "b"], params, step=1)
    assert [r.sample_id for r in requests] == ["a", "b"] and [r.sample_id for r in results] == ["a", "b"]
    assert version == 0 and engine.built_in and engine.built_in[0] != threading.current_thread().name
    assert pre.issue(_requests(["c"]), params, version=1, step=2)
    results, version, requests = pre.take(["c"], params, step=2)
    assert [r.sample_id for r in requests] == ["c"] and version == 1


def test_builder_needs_sample_ids_and_other_samples_are_discarded():
    engine = Engine()
    pre = RolloutPrefetcher(engine, max_staleness_steps=1)
    params = DecodingParams(8)
    with pytest.raises(ValueError, match="sample_ids"):
        pre.issue(lambda: _requests(["a"]), params, version=0, step=1)
    pre.issue(lambda: _requests(["a"]), params, version=0, step=1, sample_ids=["a"])
    assert pre.take(["z"], params, step=1) is None
    assert pre.pop_stats()["prefetch_discarded"] == 1
