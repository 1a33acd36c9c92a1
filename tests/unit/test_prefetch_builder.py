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
    results, version, requests, finished = pre.take(["a", "b"], params, step=1)
    assert [r.sample_id for r in requests] == ["a", "b"] and [r.sample_id for r in results] == ["a", "b"]
    assert version == 0 and engine.built_in and engine.built_in[0] != threading.current_thread().name
    assert pre.issue(_requests(["c"]), params, version=1, step=2)
    results, version, requests, finished = pre.take(["c"], params, step=2)
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


def test_finish_runs_on_the_prefetchers_thread_after_the_decode():
    engine = Engine()
    pre = RolloutPrefetcher(engine, max_staleness_steps=1)
    params = DecodingParams(8)
    seen = []

    def finish(requests, results):
        seen.append(threading.current_thread().name)
        return [(q.sample_id, r.response_token_ids) for q, r in zip(requests, results)]

    assert pre.issue(lambda: _requests(["a", "b"]), params, version=0, step=1, sample_ids=["a", "b"], finish=finish)
    results, version, requests, finished = pre.take(["a", "b"], params, step=1)
    assert finished == [("a", (7,)), ("b", (7,))] and [r.sample_id for r in results] == ["a", "b"]
    assert seen and seen[0].startswith("rollout-finish") and seen[0] not in engine.built_in


def test_a_finish_that_raises_leaves_the_work_to_the_caller():
    engine = Engine()
    pre = RolloutPrefetcher(engine, max_staleness_steps=1)
    params = DecodingParams(8)

    def finish(requests, results):
        raise ValueError("prompt ids differ")

    pre.issue(lambda: _requests(["a"]), params, version=0, step=1, sample_ids=["a"], finish=finish)
    results, version, requests, finished = pre.take(["a"], params, step=1)
    assert finished is None and [r.sample_id for r in results] == ["a"]
    with pytest.raises(ValueError, match="builder"):
        pre.issue(_requests(["b"]), params, version=0, step=2, finish=lambda q, r: None)
