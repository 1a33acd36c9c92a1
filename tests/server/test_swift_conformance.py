"""Conformance with ms-swift's own protocol code (installed by mk/grpo.mk): our client's requests build
ms-swift's ``RolloutInferRequest``/``RequestConfig``, our server's answers validate as ms-swift's
``RolloutOutput``, ms-swift's own client talks to our server, and our flat buckets decode with theirs."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from trainer.rollout.server_client import infer_request, request_config
from trainer.rollout.types import DecodingParams, RolloutRequest
from trainer.server.protocol import RequestConfigIn, RolloutInferRequestIn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("swift") is None,
                                reason="ms-swift not installed (make setup installs it via mk/grpo.mk)")


@pytest.fixture(scope="module")
def swift_protocol():
    from swift.infer_engine import protocol

    return protocol


def test_our_models_mirror_swift_fields(swift_protocol):
    swift_req = {f.name for f in dataclasses.fields(swift_protocol.RolloutInferRequest)}
    swift_cfg = {f.name for f in dataclasses.fields(swift_protocol.RequestConfig)}
    assert swift_req <= set(RolloutInferRequestIn.model_fields), swift_req - set(RolloutInferRequestIn.model_fields)
    assert swift_cfg <= set(RequestConfigIn.model_fields), swift_cfg - set(RequestConfigIn.model_fields)


def test_client_payloads_build_swift_objects(swift_protocol):
    req = RolloutRequest("id-7", ({"role": "user", "content": [{"type": "image", "image": "/data/a.png"},
                                                               {"type": "text", "text": "Detect."}]},), (1, 2, 3))
    payload = infer_request(req)
    swift_req = swift_protocol.RolloutInferRequest(**payload)
    assert swift_req.images == ["/data/a.png"] and swift_req.uuid == "id-7"
    cfg = swift_protocol.RequestConfig(**request_config(DecodingParams(max_new_tokens=12, seed=3)))
    assert cfg.return_details and cfg.max_tokens == 12 and cfg.seed == 3 and cfg.n == 1


def test_swift_client_against_our_server(swift_protocol, scripted_server, tiny_text_dir, tiny_tok):
    from swift.rlhf_trainers.vllm_client import VLLMClient

    with scripted_server(tiny_text_dir) as (url, engine), scripted_server(tiny_text_dir) as (url2, _):
        client = VLLMClient(base_urls=[url, url2], connection_timeout=10)
        assert client.get_engine_type()["engine_type"] == "LLMEngine"
        reqs = [swift_protocol.RolloutInferRequest(messages=[{"role": "user", "content": f"Scene: {i}"}], uuid=f"u{i}")
                for i in range(3)]
        outs = client.infer(reqs, swift_protocol.RequestConfig(max_tokens=16, temperature=0.0, return_details=True))
        assert len(outs) == 3 and all(isinstance(o, swift_protocol.RolloutOutput) for o in outs)
        for i, out in enumerate(outs):
            text = tiny_tok.apply_chat_template([{"role": "user", "content": f"Scene: {i}"}], tokenize=False,
                                                add_generation_prompt=True)
            assert out.response.prompt_token_ids == tiny_tok(text, add_special_tokens=False)["input_ids"]
            assert out.response.choices[0].token_ids[-1] == tiny_tok.convert_tokens_to_ids("<|im_end|>")
        client.reset_prefix_cache()
        assert client.get_model_state_keys() == []


def test_our_buckets_decode_with_swift_bucket():
    from swift.rlhf_trainers.utils import FlattenedTensorBucket, FlattenedTensorMetadata

    from trainer.sync.buckets import flatten

    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(2).bfloat16())]
    metas, bucket = flatten(named)
    theirs = FlattenedTensorBucket(metadata=[FlattenedTensorMetadata(**m.model_dump()) for m in metas],
                                   flattened_tensor=bucket).reconstruct_tensors()
    for name, t in named:
        assert torch.equal(theirs[name], t)
