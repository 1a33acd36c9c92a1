"""Our rollout server (scripted engine) over real HTTP: every ms-swift protocol endpoint, validation with
clear 4xx answers, the bearer-token guard, and our in-band weight transport."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

MSGS = [{"role": "user", "content": "Detect every object.\nScene: red circle"}]


def infer_body(n=2, **config):
    reqs = [{"messages": [{"role": "user", "content": f"Detect every object.\nScene: item {i}"}], "images": [],
             "uuid": f"s{i}"} for i in range(n)]
    return {"infer_requests": reqs, "request_config": {"max_tokens": 32, "temperature": 0.0, "return_details": True,
                                                       **config},
            "metrics": None, "use_tqdm": None, "adapter_request": None}


def test_every_endpoint_answers_like_swift_rollout(scripted_server, http, tiny_text_dir, tiny_tok):
    with scripted_server(tiny_text_dir) as (url, _):
        assert http.get(url + "/health/").json() == {"status": "ok"}
        assert http.get(url + "/health").json() == {"status": "ok"}
        assert http.get(url + "/get_world_size/").json() == {"world_size": 1}
        et = http.post(url + "/get_engine_type/").json()
        assert et == {"engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False, "enable_lora": True}
        assert http.get(url + "/get_model_state_keys/").json() == {"keys": []}
        for path in ("/reset_prefix_cache/", "/reset_encoder_cache/", "/reset_mm_cache/", "/process_weights_after_loading/",
                     "/close_communicator/"):
            r = http.post(url + path)
            assert r.status_code == 200, (path, r.text)
            assert "message" in r.json()

        items = http.post(url + "/infer/", json=infer_body(3)).json()
        assert len(items) == 3
        for i, item in enumerate(items):
            resp = item["response"]
            text = tiny_tok.apply_chat_template([{"role": "user", "content": f"Detect every object.\nScene: item {i}"}],
                                                tokenize=False, add_generation_prompt=True)
            assert resp["prompt_token_ids"] == tiny_tok(text, add_special_tokens=False)["input_ids"]
            choice = resp["choices"][0]
            assert choice["token_ids"][-1] == tiny_tok.convert_tokens_to_ids("<|im_end|>")
            assert choice["finish_reason"] == "stop"
            assert choice["message"]["role"] == "assistant"
            assert resp["usage"]["completion_tokens"] == len(choice["token_ids"])
        again = http.post(url + "/infer/", json=infer_body(3)).json()
        assert [a["response"]["choices"][0]["token_ids"] for a in again] == [i["response"]["choices"][0]["token_ids"] for i in items]
        assert http.post(url + "/infer/", json=infer_body(0)).json() == []


def test_replayed_answers_by_uuid_and_truncation(scripted_server, http, tiny_text_dir, tiny_tok):
    with scripted_server(tiny_text_dir, responses={"s1": '{"object_1": {"desc": "x"}}'}) as (url, _):
        items = http.post(url + "/infer/", json=infer_body(2)).json()
        ids = items[1]["response"]["choices"][0]["token_ids"]
        assert tiny_tok.decode(ids[:-1]) == '{"object_1": {"desc": "x"}}'
        cut = http.post(url + "/infer/", json=infer_body(2, max_tokens=3)).json()[1]["response"]
        assert cut["choices"][0]["token_ids"] == ids[:3]
        assert cut["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, fragment", [
    ({"infer_requests": [{"images": []}]}, 422, "infer_requests.0.messages"),
    ({"infer_requests": [], "bogus": 1}, 422, "bogus"),
    ({"infer_requests": [{"messages": [{"role": "robot", "content": "x"}]}]}, 422, "role"),
    ({"infer_requests": [{"messages": MSGS}], "request_config": {"max_tokens": 0}}, 422, "max_tokens"),
    ({"infer_requests": [{"messages": MSGS}], "request_config": {"n": 2}}, 400, "n=2"),
    ({"infer_requests": [{"messages": MSGS}], "request_config": {"stop": ["}"]}}, 400, "stop strings"),
    ({"infer_requests": [{"messages": MSGS, "images": ["/nonexistent.png"]}]}, 400, "image"),
])
def test_bad_requests_get_clear_4xx(scripted_server, http, tiny_text_dir, body, status, fragment):
    with scripted_server(tiny_text_dir) as (url, _):
        r = http.post(url + "/infer/", json=body)
        assert r.status_code == status, r.text
        assert fragment in r.json()["detail"]


def test_body_size_limit(serve, http):
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    with serve(create_app(ScriptedEngine(), max_body_bytes=1000, max_inband_bytes=2000)) as url:
        big = {"infer_requests": [{"messages": [{"role": "user", "content": "x" * 2000}]}]}
        r = http.post(url + "/infer/", json=big)
        assert r.status_code == 413 and "1000 bytes" in r.json()["detail"]
        blob = save({"w": torch.zeros(1000)})
        r = http.post(url + "/rm/update_weights_inband/", params={"kind": "full"}, content=blob)
        assert r.status_code == 413 and "2000 bytes" in r.json()["detail"]


def test_api_key_guards_everything_but_health(scripted_server, http):
    with scripted_server(api_key="s3cret") as (url, _):
        assert http.get(url + "/health/").status_code == 200
        for method, path in (("get", "/get_world_size/"), ("post", "/get_engine_type/"), ("post", "/infer/"),
                             ("post", "/reset_prefix_cache/"), ("post", "/rm/update_weights_inband/?kind=full"),
                             ("get", "/rm/identity/")):
            r = getattr(http, method)(url + path)
            assert r.status_code == 401, path
            r = getattr(http, method)(url + path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
        ok = http.post(url + "/infer/", json=infer_body(1), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()) == 1


def test_inband_weight_updates_change_answers_and_are_recorded(scripted_server, http):
    from trainer.server.scripted import tensors_digest

    with scripted_server() as (url, engine):
        before = http.post(url + "/infer/", json=infer_body(2)).json()
        weights = {"model.w": torch.randn(4, 4), "lm_head.weight": torch.randn(3, 4)}
        r = http.post(url + "/rm/update_weights_inband/", params={"kind": "full"}, content=save(weights))
        assert r.status_code == 200 and r.json()["num_tensors"] == 2
        after = http.post(url + "/infer/", json=infer_body(2)).json()
        assert [a["response"]["choices"][0]["token_ids"] for a in after] != [b["response"]["choices"][0]["token_ids"] for b in before]
        assert after[0]["rollout_infos"]["weights_version"] == tensors_digest(weights)[:16]

        lora = {"base_model.model.q.lora_A.weight": torch.randn(2, 4)}
        no_cfg = http.post(url + "/rm/update_weights_inband/", params={"kind": "adapter"}, content=save(lora))
        assert no_cfg.status_code == 400 and "peft_config" in no_cfg.json()["detail"]
        cfg = {"r": 2, "lora_alpha": 4, "target_modules": ["q"]}
        ok = http.post(url + "/rm/update_weights_inband/", params={"kind": "adapter"},
                       content=save(lora, metadata={"peft_config": json.dumps(cfg)}))
        assert ok.status_code == 200
        assert engine.updates[-1]["peft_config"] == cfg
        garbage = http.post(url + "/rm/update_weights_inband/", params={"kind": "full"}, content=b"not safetensors")
        assert garbage.status_code == 400
        info = http.get(url + "/rm/info/").json()
        assert [(u["transport"], u["kind"]) for u in info["updates"]] == [("inband", "full"), ("inband", "adapter")]


def test_nccl_on_cpu_fails_clearly_on_the_next_waiting_call(scripted_server, http):
    with scripted_server() as (url, _):
        bad = http.post(url + "/init_communicator/", json={"host": "127.0.0.1", "port": 29999, "world_size": 5})
        assert bad.status_code == 400 and "world size + 1 = 2" in bad.json()["detail"]
        r = http.post(url + "/init_communicator/", json={"host": "127.0.0.1", "port": 29999, "world_size": 2})
        assert r.status_code == 200
        after = http.post(url + "/process_weights_after_loading/")
        assert after.status_code == 400, "a refused background call is the client's error, reported once as 4xx"
        assert "was refused: NCCL weight sync needs a CUDA GPU" in after.json()["detail"]
        assert http.post(url + "/process_weights_after_loading/").status_code == 200
        meta = {"name": "w", "shape": [2, 2], "dtype": "torch.float32", "start_idx": 0, "end_idx": 15, "numel": 15}
        r = http.post(url + "/update_flattened_params/", json={"metadatas": [meta]})
        assert r.status_code == 422 and "is not 15 bytes" in r.json()["detail"]


def test_cli_serves_scripted_engine(get_free_port, http, tmp_path, trainer_serve):
    import subprocess
    import sys

    port = get_free_port()
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps({"s0": [72, 105, 0]}))
    with trainer_serve(port, "--engine", "scripted", "--responses", str(replies), "--api-key-env", "RM_KEY",
                       env={"RM_KEY": "abc"}) as (url, _):
        assert http.post(url + "/infer/", json=infer_body(1)).status_code == 401
        items = http.post(url + "/infer/", json=infer_body(2), headers={"Authorization": "Bearer abc"}).json()
        assert items[0]["response"]["choices"][0]["token_ids"] == [72, 105, 0]
        assert items[0]["response"]["choices"][0]["message"]["content"] == "Hi"
    missing = subprocess.run([sys.executable, "-m", "trainer", "serve", "--engine", "vllm", "--port", str(port)],
                             capture_output=True, text=True, timeout=600)  # bounds a hang only
    assert missing.returncode != 0 and "needs --model" in missing.stderr


def test_identity_is_one_per_server_process(scripted_server, http):
    """``/rm/identity/``'s ``boot_id``: the same for every call to one server, another for the next one started
    (what a learner compares to tell a restarted server from the process it pushed to)."""
    with scripted_server() as (url, _):
        first = http.get(url + "/rm/identity/").json()["boot_id"]
        assert http.get(url + "/rm/identity/").json()["boot_id"] == first
        assert http.get(url + "/rm/info/").json()["boot_id"] == first
    with scripted_server() as (url, _):
        assert http.get(url + "/rm/identity/").json()["boot_id"] not in (first, None, "")


@pytest.mark.parametrize("top", [None, 3])
def test_logprobs_are_the_models_own_per_token(serve, http, tiny_text_dir, top):
    """ms-swift's GRPO learner asks every rollout for ``logprobs`` (its importance-sampling correction) and reads
    ``choices[0].logprobs.content[i].logprob``; the hf engine answers with the model's log-softmax."""
    from transformers import AutoModelForCausalLM

    from tests.server.logprobs_check import check_logprobs_against_model, logprobs_body
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    with serve(create_app(HFServerEngine(tiny_text_dir))) as url:
        r = http.post(url + "/infer/", json=logprobs_body(MSGS, top))
        assert r.status_code == 200, r.text
        plain = http.post(url + "/infer/", json=infer_body(1)).json()[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32).eval()
    check_logprobs_against_model(r.json()[0], model, top, tol=1e-4)
    assert plain["response"]["choices"][0]["logprobs"] is None, "only when asked for"


def test_scripted_logprobs_are_certain_and_prompt_logprobs_are_a_clear_400(scripted_server, http, tiny_text_dir):
    with scripted_server(tiny_text_dir) as (url, _):
        r = http.post(url + "/infer/", json={"infer_requests": [{"messages": MSGS}],
                                             "request_config": {"logprobs": True}})
        choice = r.json()[0]["response"]["choices"][0]
        assert r.status_code == 200 and len(choice["logprobs"]["content"]) == len(choice["token_ids"]) > 0
        assert {e["logprob"] for e in choice["logprobs"]["content"]} == {0.0}
        r = http.post(url + "/infer/", json={"infer_requests": [{"messages": MSGS}],
                                             "request_config": {"prompt_logprobs": 2}})
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["detail"]
