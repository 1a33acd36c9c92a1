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


def test_our_infer_answer_has_every_field_of_swift_rollout(swift_protocol, scripted_server, http, tmp_path):
    """The real ``swift rollout`` (ms-swift 4.6, on the H200) answers the multi-turn fields, ``prompt_logprobs`` and
    ``images_size`` too (H200, 2026-11-25): our server answers the same keys, and
    ``images_size`` is each image's (width, height)."""
    import dataclasses

    from PIL import Image

    from trainer.modeling.fixtures import save_tiny_model

    Image.new("RGB", (40, 24)).save(tmp_path / "a.png")
    with scripted_server(save_tiny_model(tmp_path / "vl", "vl", seed=0)) as (url, _):
        items = http.post(url + "/infer/", json={
            "infer_requests": [{"messages": [{"role": "user", "content": "Scene"}]},
                               {"messages": [{"role": "user", "content": "<image>Scene"}],
                                "images": [str(tmp_path / "a.png")]}],
            "request_config": {"max_tokens": 8, "return_details": True}}).json()
    assert isinstance(items, list), items
    choice = swift_protocol.ChatCompletionResponseChoice(index=0, message=swift_protocol.ChatMessage(
        role="assistant", content="x"), finish_reason="stop", logprobs=None, token_ids=[1])
    theirs = swift_protocol.RolloutOutput(response=swift_protocol.ChatCompletionResponse(
        model="m", choices=[choice], usage=swift_protocol.UsageInfo(1, 1, 2), prompt_token_ids=[1]))
    their_keys = set(theirs.model_dump().keys())
    their_response_keys = {f.name for f in dataclasses.fields(swift_protocol.ChatCompletionResponse)}
    for item in items:
        assert set(item) == their_keys, set(item) ^ their_keys
        assert set(item["response"]) == their_response_keys, set(item["response"]) ^ their_response_keys
        parsed = swift_protocol.RolloutOutput.model_validate(item)
        assert parsed.response_token_ids == [] and parsed.messages is None
    assert items[0]["response"]["images_size"] is None and items[1]["response"]["images_size"] == [[40, 24]]


def test_swift_client_per_tensor_adapter_sync_reaches_our_server(scripted_server, tiny_text_dir, get_free_port, http,
                                                                 monkeypatch):
    """ms-swift's ``VLLMClient.update_adapter_param`` (its GRPO trainer with ``enable_flattened_weight_sync false``):
    ``POST /update_adapter_param/``, one broadcast per tensor, one barrier. The real ``swift rollout`` has the route
    (found by the H200 peers check); ours takes it — here over gloo with swift's own client code."""
    import contextlib
    import types

    from peft import LoraConfig
    from swift.rlhf_trainers import vllm_client
    from swift.rlhf_trainers.vllm_client import VLLMClient

    from trainer.server.scripted import tensors_digest
    from trainer.sync.nccl import join_group

    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 64),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 8),
            "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.randn(8, 64)}
    # CPU shims for swift's device helpers (``torch.cpu`` has no ``device`` context; its ``synchronize`` always calls
    # CUDA); the request, metadata, broadcast order and barrier are swift's own code
    monkeypatch.setattr(vllm_client, "get_torch_device",
                        lambda: types.SimpleNamespace(device=lambda _d: contextlib.nullcontext()))
    monkeypatch.setattr(vllm_client, "synchronize", lambda *_a, **_k: None)
    with scripted_server(tiny_text_dir) as (url, engine):
        client = VLLMClient(base_urls=[url], connection_timeout=10)
        port = get_free_port()
        resp = http.post(url + "/init_communicator/",
                         json={"host": "127.0.0.1", "port": port, "world_size": 2, "backend": "torch-gloo"})
        assert resp.status_code == 200, resp.text
        client.pynccl_comms = [join_group("torch", "127.0.0.1", port, 1, 2, torch.device("cpu"))]
        client.update_adapter_param(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "up_proj"]), lora)
        assert http.post(url + "/process_weights_after_loading/").status_code == 200  # after the fired receive
        update = engine.updates[-1]
        assert update["kind"] == "adapter" and update["num_tensors"] == 3
        assert update["digest"] == tensors_digest(lora), "the adapter arrived bit for bit"
        assert update["peft_config"]["r"] == 8
        bad = http.post(url + "/update_adapter_param/", json={"peft_config": {}, "lora_tensors_metadata": [
            {"name": "a", "dtype": "torch.float32", "shape": [2, 3], "start_idx": 0, "end_idx": 6, "numel": 5}]})
        assert bad.status_code == 422 and "numel 5 is not the 6 elements" in bad.text
