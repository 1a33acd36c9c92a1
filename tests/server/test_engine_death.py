"""A rollout server whose engine dies (vLLM's ``EngineDeadError``, a context-poisoning CUDA error) answers 503 saying
so, fails ``/health/`` and exits with code 75 to be restarted; an out-of-memory error is answered and served on."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from tests.server.conftest import serve_app
from trainer.server.app import create_app
from trainer.server.fatal import EXIT_ENGINE_DEAD
from trainer.server.scripted import ScriptedEngine

INFER = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}], "uuid": "s0"}],
         "request_config": {"max_tokens": 8}}


def _assert_dead(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    detail = r.json()["detail"]
    assert "engine is dead" in detail and f"exiting (code {EXIT_ENGINE_DEAD})" in detail, detail


class _OutOfMemory(ScriptedEngine):
    def generate(self, requests, params):
        self.generate_calls += 1
        if self.generate_calls == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().generate(requests, params)


class _QuotesTheRequest(ScriptedEngine):
    def generate(self, requests, params):
        from trainer.server.codec import EngineRequestError

        raise EngineRequestError("image 'CUDA error: an illegal memory access.png' not found")


class _DiesInBackground(ScriptedEngine):
    def nccl_receive_named(self, name, dtype, shape):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_dead_engine_answers_503_fails_health_and_calls_the_exit_hook_once():
    engine = ScriptedEngine(die_after_calls=1)
    deaths: list[str] = []
    with serve_app(create_app(engine, on_engine_death=deaths.append)) as url, httpx.Client(timeout=30) as c:
        assert c.post(url + "/infer/", json=INFER).status_code == 200
        assert c.get(url + "/health/").status_code == 200
        r = c.post(url + "/infer/", json=INFER)
        _assert_dead(r)
        assert "FatalEngineError: scripted engine died at generate call 2" in r.json()["detail"]
        assert r.json()["engine_dead"] is True
        health = c.get(url + "/health/")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        _assert_dead(c.post(url + "/infer/", json=INFER))
        _assert_dead(c.post(url + "/reset_prefix_cache/"))
        _assert_dead(c.post(url + "/update_named_param/", json={"name": "w", "dtype": "float32", "shape": [2]}))
        assert engine.generate_calls == 2, "the dead engine was called again"
    assert len(deaths) == 1 and "scripted engine died" in deaths[0]


def test_out_of_memory_is_answered_and_the_server_keeps_serving():
    deaths: list[str] = []
    with serve_app(create_app(_OutOfMemory(), on_engine_death=deaths.append)) as url, httpx.Client(timeout=30) as c:
        r = c.post(url + "/infer/", json=INFER)
        assert r.status_code == 500 and "out of memory" in r.json()["detail"], r.text
        assert c.get(url + "/health/").status_code == 200
        assert c.post(url + "/infer/", json=INFER).status_code == 200
    assert deaths == []


def test_a_refused_request_quoting_a_cuda_error_is_not_a_death():
    deaths: list[str] = []
    with serve_app(create_app(_QuotesTheRequest(), on_engine_death=deaths.append)) as url, httpx.Client(timeout=30) as c:
        assert c.post(url + "/infer/", json=INFER).status_code == 400
        assert c.get(url + "/health/").status_code == 200
    assert deaths == []


def test_death_in_a_background_call_fails_health_and_the_next_call():
    deaths: list[str] = []
    app = create_app(_DiesInBackground(), on_engine_death=deaths.append)
    with serve_app(app) as url, httpx.Client(timeout=30) as c:
        r = c.post(url + "/update_named_param/", json={"name": "w", "dtype": "float32", "shape": [2]})
        assert r.status_code == 200, r.text  # answered before the background receive runs
        deadline = time.monotonic() + 30
        while c.get(url + "/health/").status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 after the engine died"
            time.sleep(0.05)
        r = c.post(url + "/process_weights_after_loading/")
        _assert_dead(r)
        assert "illegal memory access" in r.json()["detail"]
    assert len(deaths) == 1


@pytest.mark.timeout(180)
def test_serve_process_exits_with_code_75_when_its_engine_dies():
    from trainer.launch.health import serve_subprocess

    with serve_subprocess("--engine", "scripted", "--die-after-calls", "1", timeout_s=120) as (url, proc, _):
        with httpx.Client(timeout=30) as c:
            assert c.post(url + "/infer/", json=INFER).status_code == 200
            _assert_dead(c.post(url + "/infer/", json=INFER))
            try:
                status = c.get(url + "/health/").status_code
            except httpx.TransportError:
                status = None  # already stopped listening
            assert status in (503, None)
        assert proc.wait(60) == EXIT_ENGINE_DEAD


def test_learner_retries_a_dead_servers_chunk_elsewhere_and_quarantines_it(scripted_server, tiny_tok, chat_requests):
    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.rollout.types import DecodingParams

    with scripted_server() as (a, _), scripted_server(die_after_calls=0) as (dead, _), scripted_server() as (b, _):
        client = ServerRolloutEngine([ServerEndpoint(a), ServerEndpoint(dead), ServerEndpoint(b)], timeout_s=10,
                                     max_retries=1)
        reqs = chat_requests(tiny_tok, 7)
        res = client.generate(reqs, DecodingParams(max_new_tokens=32))
        assert [r.sample_id for r in res] == [r.sample_id for r in reqs]
        assert {r.extra["server"] for r in res} == {a, b} and client.quarantined == {dead}
        assert httpx.get(dead + "/health/", timeout=10).status_code == 503  # the re-admission probe fails too
