"""Fuzzing the rollout server's HTTP surface (hypothesis): arbitrary JSON, schema-shaped payloads with wrong or
extreme values, raw bytes and hostile hand-picked inputs against every endpoint that takes a body. Every answer
must be 200 or a 4xx with a non-empty ``detail`` message (never a 500, never a crash of the app), and bodies over
the size limit are refused with 413 whether or not they declare their length.

The scripted engine runs with a tiny VL model's tokenizer and image processor, so prompts are really encoded
(chat template, image placeholders, image loading) while answers stay cheap."""

from __future__ import annotations

import base64
import json
import os

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.server.app import create_app
from trainer.server.scripted import ScriptedEngine

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=30))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                           max_leaves=25)


def maybe(strategy):
    """Mostly the schema-shaped value, sometimes any JSON (so validation and the code behind it both get hit)."""
    return st.integers(0, 24).flatmap(lambda i: json_values if i == 0 else strategy)


part = st.fixed_dictionaries({}, optional={
    "type": maybe(st.sampled_from(["text", "image", "video", "audio", ""])),
    "text": maybe(st.text(max_size=40)),
    "image": maybe(st.sampled_from(["/nonexistent.png", "", "data:image/png;base64,AAAA", "http://x/y.png", "iVBORw0K"])),
})
message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "user", "assistant", "tool"]))},
                                optional={"content": maybe(st.text(max_size=60) | st.lists(part, max_size=4)
                                                           | st.sampled_from(["<image>", "<image><image>x", "a<image>"]))})
infer_request = st.fixed_dictionaries({"messages": maybe(st.lists(message, min_size=1, max_size=4))}, optional={
    "images": maybe(st.lists(st.sampled_from(["/nonexistent.png", "", "AAAA", "data:,", "not base64!"]) | st.text(max_size=20),
                             max_size=3) | st.text(max_size=20)),
    "uuid": maybe(st.text(max_size=10)),
    "chat_template_kwargs": maybe(st.dictionaries(st.sampled_from(["add_generation_prompt", "tokenize", "tools",
                                                                   "enable_thinking", "x"]), json_values, max_size=2)),
    "objects": maybe(st.dictionaries(st.text(max_size=5), json_values, max_size=2)),
    "tools": maybe(st.none()), "add_eos": maybe(st.none() | st.booleans() | st.just("auto")),
})
request_config = st.fixed_dictionaries({}, optional={  # in range (the wrong-typed ones come from ``maybe``)
    "max_tokens": st.none() | st.integers(1, 64) | st.integers(1, 2**62),
    "temperature": st.none() | st.floats(0, 5), "top_k": st.none() | st.integers(-1, 2**40),
    "top_p": st.none() | st.floats(0.01, 1), "min_p": st.none() | st.floats(0, 1),
    "repetition_penalty": st.none() | st.floats(0.01, 5), "num_beams": st.integers(1, 3),
    "seed": st.none() | st.integers(-2**63, 2**70), "n": st.integers(1, 3), "logprobs": st.booleans(),
    "stream": st.booleans(), "stop": st.none() | st.lists(st.text(max_size=3), max_size=2),
    "return_details": st.booleans(), "structured_outputs_regex": st.none() | st.text(max_size=5),
})
shaped_body = st.fixed_dictionaries({"infer_requests": maybe(st.lists(infer_request, max_size=4))}, optional={
    "request_config": maybe(request_config),
    "metrics": json_values, "use_tqdm": maybe(st.none() | st.booleans()), "adapter_request": maybe(st.none()),
})
unknown_key = st.fixed_dictionaries({"infer_requests": st.lists(infer_request, max_size=2), "unexpected": json_values})
infer_body = st.integers(0, 9).flatmap(lambda i: unknown_key if i == 0 else shaped_body)
meta = st.fixed_dictionaries({}, optional={
    "name": maybe(st.text(max_size=10)), "shape": maybe(st.lists(st.integers(-3, 2**40), max_size=4)),
    "dtype": maybe(st.sampled_from(["torch.float32", "torch.bfloat16", "float32", "torch.complex64", ""])),
    "start_idx": maybe(st.integers(-5, 2**40)), "end_idx": maybe(st.integers(-5, 2**40)),
    "numel": maybe(st.integers(-5, 2**40)),
})
weight_bodies = {
    "/init_communicator/": st.fixed_dictionaries({}, optional={
        "host": maybe(st.text(max_size=20)), "port": maybe(st.integers(-10, 70000)),
        "world_size": maybe(st.integers(-3, 5)), "client_device_uuid": json_values}),
    "/update_named_param/": st.fixed_dictionaries({}, optional={
        "name": maybe(st.text(max_size=10)), "dtype": json_values, "shape": maybe(st.lists(st.integers(-3, 2**40)))}),
    "/update_flattened_params/": st.fixed_dictionaries({}, optional={"metadatas": maybe(st.lists(meta, max_size=3))}),
    "/update_adapter_flattened_param/": st.fixed_dictionaries({}, optional={
        "peft_config": json_values, "metadatas": maybe(st.lists(meta, max_size=3))}),
}


def check(resp, what) -> None:
    assert resp.status_code < 500, f"{what}: HTTP {resp.status_code} {resp.text[:500]}"
    if resp.status_code != 200:
        assert 400 <= resp.status_code < 500
        detail = resp.json().get("detail")
        assert detail and (isinstance(detail, str) or isinstance(detail, list)), f"{what}: no message: {resp.text[:300]}"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from trainer.modeling.fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("fuzz") / "vl", "vl", seed=0)


@pytest.fixture(scope="module")
def client(vl_dir):
    with TestClient(create_app(ScriptedEngine(vl_dir)), raise_server_exceptions=False) as c:
        yield c


def fresh_client():
    """A new app per example for endpoints that start background weight-receive work (no state carried over)."""
    return TestClient(create_app(ScriptedEngine()), raise_server_exceptions=False)


@SETTINGS
@given(body=st.integers(0, 9).flatmap(lambda i: json_values if i == 0 else infer_body))
def test_infer_never_500(client, body):
    check(client.post("/infer/", content=json.dumps(body), headers={"content-type": "application/json"}), body)


@SETTINGS
@given(path=st.sampled_from(sorted(weight_bodies)), data=st.data())
def test_weight_update_endpoints_never_500(path, data):
    body = data.draw(json_values | weight_bodies[path])
    with fresh_client() as c:
        check(c.post(path, content=json.dumps(body), headers={"content-type": "application/json"}), (path, body))
        # a refused background receive surfaces on the next waiting call as a 4xx naming it, once
        check(c.post("/process_weights_after_loading/"), ("wait after", path, body))
        assert c.post("/process_weights_after_loading/").status_code == 200


@settings(max_examples=60, deadline=None)
@given(blob=st.binary(max_size=300), kind=st.sampled_from(["full", "adapter", "bogus", ""]))
def test_inband_update_never_500(blob, kind):
    with fresh_client() as c:
        check(c.post("/rm/update_weights_inband/", params={"kind": kind}, content=blob), (kind, blob[:40]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/infer/", "/init_communicator/", "/update_flattened_params/"]))
def test_raw_bytes_never_500(client, raw, path):
    check(client.post(path, content=raw, headers={"content-type": "application/json"}), (path, raw[:40]))


def test_hostile_inputs_get_clear_4xx(client, tmp_path):
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("hello")
    tiny_png = tmp_path / "tiny.png"
    from PIL import Image

    Image.new("RGB", (1, 1)).save(tiny_png)
    cases = {
        "non-image file": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                               "images": [str(not_an_image)]}]},
        "directory as image": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                                   "images": [str(tmp_path)]}]},
        "path too long": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                              "images": ["a/" * 3000]}]},
        "NUL in path": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                            "images": ["/tmp/a\x00b.png"]}]},
        "base64 garbage image": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                                     "images": [base64.b64encode(os.urandom(64)).decode()]}]},
        "1x1 image": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}],
                                          "images": [str(tiny_png)]}]},
        "more tags than images": {"infer_requests": [{"messages": [{"role": "user", "content": "<image><image>"}],
                                                      "images": [str(tiny_png)]}]},
        "image URL": {"infer_requests": [{"messages": [{"role": "user", "content": "<image>"}],
                                          "images": ["https://example.com/x.png"]}]},
        "bad chat_template_kwargs": {"infer_requests": [{"messages": [{"role": "user", "content": "x"}],
                                                         "chat_template_kwargs": {"tokenize": True, "messages": 3}}]},
        "too many requests": {"infer_requests": [{"messages": [{"role": "user", "content": "x"}]}] * 4097},
        "too many messages": {"infer_requests": [{"messages": [{"role": "user", "content": "x"}] * 257}]},
    }
    answers = {}
    for name, body in cases.items():
        r = client.post("/infer/", json=body)
        check(r, name)
        answers[name] = r.status_code
    assert all(code in (400, 422) for name, code in answers.items() if name != "1x1 image"), answers
    deep = "[" * 50000 + "]" * 50000
    check(client.post("/infer/", content=deep, headers={"content-type": "application/json"}), "deeply nested JSON")
    check(client.post("/infer/", content=b"\xff\xfe{", headers={"content-type": "application/json"}), "not UTF-8")
    check(client.post("/infer/", content="{}", headers={"content-type": "text/plain"}), "wrong content type")


def test_oversize_bodies_are_refused_declared_or_streamed(tmp_path):
    app = create_app(ScriptedEngine(), max_body_bytes=10_000, max_inband_bytes=20_000)
    with TestClient(app, raise_server_exceptions=False) as c:
        body = json.dumps({"infer_requests": [{"messages": [{"role": "user", "content": "x" * 20_000}]}]})
        r = c.post("/infer/", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "10000 bytes" in r.json()["detail"]

        def chunks():  # no content-length: the limit must hold on the streamed size
            for _ in range(30):
                yield b" " * 1000

        r = c.post("/infer/", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "10000 bytes" in r.json()["detail"]
        r = c.post("/rm/update_weights_inband/", params={"kind": "full"}, content=b"\0" * 25_000)
        assert r.status_code == 413 and "20000 bytes" in r.json()["detail"]
        ok = c.post("/infer/", json={"infer_requests": [{"messages": [{"role": "user", "content": "x"}]}]})
        assert ok.status_code == 200, "the app keeps serving after refusals"
    from trainer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INBAND_BYTES

    assert DEFAULT_MAX_BODY_BYTES == 64 * 2**20 and DEFAULT_MAX_INBAND_BYTES == 4 * 2**30

