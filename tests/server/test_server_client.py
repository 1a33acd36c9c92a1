"""Server-mode client against real scripted servers over HTTP: deterministic chunking and reassembly,
N == 0, stalled and missing servers, multi-rank learners, and weight sync end to end (in-band transport)."""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.server.stall import INFER_TIMEOUT_S
from trainer.rollout.server_client import (
    RolloutServerError,
    ServerEndpoint,
    ServerRolloutEngine,
    contiguous_chunks,
    infer_request,
    servers_for_rank,
)
from trainer.rollout.types import DecodingParams, RolloutRequest, check_prompt_alignment
from trainer.server.protocol import InferBody, RequestConfigIn
from trainer.sync.policy import SyncModeError, WeightSync

PARAMS = DecodingParams(max_new_tokens=32)


@contextlib.contextmanager
def n_servers(scripted_server, n, model_dir=None, **kwargs):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(scripted_server(model_dir, **kwargs)) for _ in range(n)]


@given(st.integers(0, 200), st.integers(1, 9))
def test_contiguous_chunks_cover_in_order(n, k):
    spans = contiguous_chunks(n, k)
    assert len(spans) == k
    flat = [i for a, b in spans for i in range(a, b)]
    assert flat == list(range(n))
    size = -(-n // k)
    assert all(b - a <= size for a, b in spans)
    assert [b - a for a, b in spans if b > a] == [b - a for a, b in spans][: len([1 for a, b in spans if b > a])]


@given(st.integers(1, 12), st.integers(1, 12))
def test_servers_for_rank_is_a_deterministic_partition(num_servers, world):
    assignment = [servers_for_rank(num_servers, r, world) for r in range(world)]
    assert all(assignment[r] for r in range(world)), "every rank needs a server"
    assert assignment == [servers_for_rank(num_servers, r, world) for r in range(world)]
    if num_servers >= world:
        assert sorted(s for a in assignment for s in a) == list(range(num_servers))
    else:
        assert all(len(a) == 1 for a in assignment)
        assert {a[0] for a in assignment} == set(range(num_servers))


def test_payloads_validate_against_the_protocol_models(tiny_tok):
    req = RolloutRequest("a1", ({"role": "user", "content": [{"type": "image", "image": "/img/1.png"},
                                                             {"type": "text", "text": "Detect."}]},), (1, 2))
    payload = infer_request(req)
    assert payload["messages"] == [{"role": "user", "content": "<image>Detect."}]
    assert payload["images"] == ["/img/1.png"] and payload["uuid"] == "a1"
    from trainer.rollout.server_client import request_config

    body = InferBody.model_validate({"infer_requests": [payload], "request_config": request_config(PARAMS),
                                     "metrics": None, "use_tqdm": None, "adapter_request": None})
    assert body.request_config == RequestConfigIn(max_tokens=32, temperature=0.0, top_k=-1, top_p=1.0,
                                                  repetition_penalty=1.0, return_details=True)


def test_a_text_prompt_sends_no_images_even_when_the_record_has_them():
    """A text model's prompt places no image (the scene text stands for it), so the record's images are not sent: a
    server would answer 400 ('image(s) in the request have no placeholder'), as ``serve --engine vllm`` did on the
    H100 in server-mode training on the tiny text model."""
    req = RolloutRequest("t1", ({"role": "user", "content": "Detect.\nScene: a red square"},), (1, 2),
                         images=("/img/1.png",))
    payload = infer_request(req)
    assert payload["images"] == [] and payload["messages"][0]["content"].endswith("a red square")


def test_three_servers_chunk_in_order_and_n0_is_a_noop(scripted_server, tiny_text_dir, tiny_tok, chat_requests):
    with n_servers(scripted_server, 3, tiny_text_dir) as servers:
        client = ServerRolloutEngine([ServerEndpoint(u) for u, _ in servers], timeout_s=10)
        reqs = chat_requests(tiny_tok, 7)
        results = client.generate(reqs, PARAMS)
        check_prompt_alignment(reqs, results)
        assert [r.extra["server"] for r in results] == [servers[0][0]] * 3 + [servers[1][0]] * 3 + [servers[2][0]]
        assert [e.generate_calls for _, e in servers] == [1, 1, 1]
        again = client.generate(reqs, PARAMS)
        assert [r.response_token_ids for r in again] == [r.response_token_ids for r in results]
        two = client.generate(reqs[:2], PARAMS)
        assert [r.extra["server"] for r in two] == [servers[0][0], servers[1][0]]
        assert [e.generate_calls for _, e in servers] == [3, 3, 2], "servers given no request must not be called"
        assert client.generate([], PARAMS) == []
        assert [e.generate_calls for _, e in servers] == [3, 3, 2]
        client.close()


def test_two_learner_ranks_use_their_own_servers(scripted_server, tiny_text_dir, tiny_tok, chat_requests):
    with n_servers(scripted_server, 3, tiny_text_dir) as servers:
        eps = [ServerEndpoint(u) for u, _ in servers]
        r0 = ServerRolloutEngine(eps, rank=0, world_size=2, timeout_s=10)
        r1 = ServerRolloutEngine(eps, rank=1, world_size=2, timeout_s=10)
        res0 = r0.generate(chat_requests(tiny_tok, 4, "a"), PARAMS)
        res1 = r1.generate(chat_requests(tiny_tok, 3, "b"), PARAMS)
        assert [r.extra["server"] for r in res0] == [servers[0][0]] * 2 + [servers[2][0]] * 2
        assert [r.extra["server"] for r in res1] == [servers[1][0]] * 3
        assert [r.sample_id for r in res1] == ["b0", "b1", "b2"]


def test_stalled_server_times_out_naming_it(scripted_server, tiny_tok, chat_requests):
    with scripted_server(stalled=True) as (slow, slow_engine), scripted_server() as (fast, _):
        client = ServerRolloutEngine([ServerEndpoint(fast), ServerEndpoint(slow)], timeout_s=10,
                                     infer_timeout_s=INFER_TIMEOUT_S, max_retries=0)
        with pytest.raises(RolloutServerError, match=rf"{slow}.*timed out.*infer_timeout_s={INFER_TIMEOUT_S}"):
            client.generate(chat_requests(tiny_tok, 2), PARAMS)
        assert slow_engine.stall.stalled.is_set() and not slow_engine.stall.finished.is_set(), \
            "the client must give up at its timeout, while the server is still stalled"


#: a hang guard, not a speed bound: a wait that ignored ``timeout_s`` (the 240 s default, or none) is still waiting
#: here, while a 1 s health wait (1 s of polls, each probe at most 1 s) has long ended however loaded the machine
HEALTH_BOUND_S = 120.0


def test_server_down_at_start(scripted_server, get_free_port, tiny_tok, chat_requests, monkeypatch):
    port = get_free_port()
    url = f"http://127.0.0.1:{port}"
    raised: list[BaseException] = []

    def construct():
        try:
            ServerRolloutEngine([ServerEndpoint(url)], timeout_s=1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    t0 = time.monotonic()
    waiter = threading.Thread(target=construct, daemon=True)  # a wait that ignores its deadline fails, not hangs
    waiter.start()
    waiter.join(HEALTH_BOUND_S)
    took = time.monotonic() - t0
    assert not waiter.is_alive(), f"timeout_s=1 was not honoured: the health wait still ran after {took:.0f}s"
    assert len(raised) == 1 and isinstance(raised[0], RolloutServerError), raised
    assert re.search(rf"not healthy after 1s.*{url}", str(raised[0])), raised[0]
    assert took >= 1.0, f"the 1 s health wait gave up after {took:.1f}s"

    # the server starts only once the client's health check has been refused: the client must keep polling
    refused = threading.Event()
    real_get = httpx.Client.get

    def get(self, target, *args, **kwargs):
        try:
            return real_get(self, target, *args, **kwargs)
        except httpx.ConnectError:
            if str(target).startswith(url):
                refused.set()
            raise

    monkeypatch.setattr(httpx.Client, "get", get)
    started = threading.Event()
    stop = threading.Event()

    def late():
        if not refused.wait(120):
            return
        with scripted_server(port=port):
            started.set()
            stop.wait(120)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    try:
        client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=120)  # 120 s bounds a hang only
        assert refused.is_set() and started.is_set(), "the client must have waited for the late server"
        assert len(client.generate(chat_requests(tiny_tok, 2), PARAMS)) == 2
    finally:
        stop.set()
        refused.set()
        thread.join(30)


@pytest.fixture(scope="module")
def tiny_model(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)


def test_full_and_adapter_sync_reach_every_server(scripted_server, tiny_model, tiny_tok):
    from peft import LoraConfig, get_peft_model

    from trainer.server.scripted import tensors_digest
    from trainer.sync.weights import adapter_weights, full_weights

    with n_servers(scripted_server, 3) as servers:
        client = ServerRolloutEngine([ServerEndpoint(u) for u, _ in servers], timeout_s=10, transport="inband")
        sync = WeightSync.for_model(client, tiny_model, "full")
        assert sync.ensure_fresh(tiny_model, 0) and not sync.ensure_fresh(tiny_model, 0)
        want = tensors_digest(full_weights(tiny_model))
        assert [e.updates[-1]["digest"] for _, e in servers] == [want] * 3

        peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                         init_lora_weights=False))
        sync = WeightSync.for_model(client, peft_model, "adapter")
        sync.ensure_fresh(peft_model, 3)
        sync.ensure_fresh(peft_model, 4)
        assert [u["kind"] for u in servers[0][1].updates] == ["full", "full", "adapter", "adapter"]
        base = tensors_digest(full_weights(peft_model, merge_adapter=False))
        assert servers[1][1].updates[1]["digest"] == base == want
        assert servers[2][1].updates[-1]["digest"] == tensors_digest(adapter_weights(peft_model).tensors)
        assert servers[2][1].updates[-1]["peft_config"]["r"] == 4
        merged = WeightSync.for_model(client, peft_model, "full")
        merged.ensure_fresh(peft_model, 5)
        assert servers[0][1].updates[-1]["digest"] == tensors_digest(full_weights(peft_model)) != base
        assert client.metadata()["transport"] == "inband"


def test_adapter_mode_without_server_lora(scripted_server, tiny_model):
    from peft import LoraConfig, get_peft_model

    with scripted_server(enable_lora=False) as (url, engine):
        client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=10, transport="inband")
        peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj"]))
        with pytest.raises(SyncModeError, match="does not serve LoRA adapters"):
            WeightSync.for_model(client, peft_model, "adapter", fallback_to_full=False)
        sync = WeightSync.for_model(client, peft_model, "adapter", fallback_to_full=True)
        assert sync.decision.mode == "full"
        sync.ensure_fresh(peft_model, 0)
        assert [u["kind"] for u in engine.updates] == ["full"]
        with pytest.raises(SyncModeError, match="needs a LoRA model"):
            WeightSync.for_model(client, tiny_model, "adapter")


def test_hf_engine_server_decodes_like_hf_and_takes_full_weights(serve, tiny_text_dir, tiny_model, tiny_tok, chat_requests):
    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    stops = sorted(stop_token_ids(tiny_tok))

    def hf(model, reqs):
        return [r.response_token_ids for r in HFRolloutEngine(model, tiny_tok.pad_token_id, stops).generate(reqs, PARAMS)]

    with serve(create_app(HFServerEngine(tiny_text_dir))) as url:
        client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=10, transport="inband")
        reqs = chat_requests(tiny_tok, 3)
        got = client.generate(reqs, PARAMS)
        check_prompt_alignment(reqs, got)
        assert [r.response_token_ids for r in got] == hf(tiny_model, reqs)
        learner = copy.deepcopy(tiny_model)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        sync = WeightSync.for_model(client, learner, "auto")
        assert sync.decision.mode == "full"
        sync.ensure_fresh(learner, 0)
        assert [r.response_token_ids for r in client.generate(reqs, PARAMS)] == hf(learner, reqs)


def test_failed_chunk_is_retried_on_the_healthy_servers_in_order(scripted_server, tiny_tok, chat_requests):
    with scripted_server(stalled=True) as (slow, _), scripted_server() as (a, _), scripted_server() as (b, _):
        client = ServerRolloutEngine([ServerEndpoint(a), ServerEndpoint(slow), ServerEndpoint(b)], timeout_s=10,
                                     infer_timeout_s=INFER_TIMEOUT_S, max_retries=1)
        reqs = chat_requests(tiny_tok, 7)
        res = client.generate(reqs, PARAMS)
        assert [r.sample_id for r in res] == [r.sample_id for r in reqs]
        assert slow not in {r.extra["server"] for r in res} and client.quarantined == {slow}
        again = client.generate(reqs, PARAMS)
        assert [r.response_token_ids for r in again] == [r.response_token_ids for r in res]
        assert {r.extra["server"] for r in again} == {a, b}
        assert client.metadata()["quarantined"] == [slow]


def test_rank_whose_servers_all_failed_borrows_the_other_ranks_healthy_servers(scripted_server, tiny_text_dir,
                                                                              tiny_tok, chat_requests):
    with scripted_server(stalled=True) as (slow, _), scripted_server() as (a, _), scripted_server() as (b, _):
        eps = [ServerEndpoint(u) for u in (a, slow, b)]
        r1 = ServerRolloutEngine(eps, rank=1, world_size=2, timeout_s=10, infer_timeout_s=INFER_TIMEOUT_S,
                                 max_retries=1)
        assert [s.base_url for s in r1.mine] == [slow]
        reqs = chat_requests(tiny_tok, 5, "b")
        res = r1.generate(reqs, PARAMS)
        assert [r.sample_id for r in res] == [r.sample_id for r in reqs], "no sample lost, order kept"
        assert r1.quarantined == {slow} and {r.extra["server"] for r in res} == {a, b}
        r1.fleet.quarantine(a, "test")
        r1.fleet.quarantine(b, "test")
        with pytest.raises(RolloutServerError, match="quarantined servers"):
            r1.generate(reqs[:1], PARAMS)


def test_retries_exhausted_names_servers_and_samples(scripted_server, tiny_tok, chat_requests):
    with scripted_server(stalled=True) as (slow1, _), scripted_server(stalled=True) as (slow2, _):
        client = ServerRolloutEngine([ServerEndpoint(slow1), ServerEndpoint(slow2)], timeout_s=10,
                                     infer_timeout_s=INFER_TIMEOUT_S, max_retries=1)
        reqs = chat_requests(tiny_tok, 3)
        with pytest.raises(RolloutServerError, match=rf"3 sample\(s\).*{reqs[0].sample_id}.*max_retries.*{slow1}"):
            client.generate(reqs, PARAMS)
