"""``python -m trainer serve --engine vllm`` (a real subprocess, vLLM on CPU) with our server-mode client:
greedy ids equal to the HF model's, and weight sync (full and LoRA adapter, in-band transport) end to end."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch

from trainer.launch.ports import listen_port as _free_port  # below the ephemeral range
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
from trainer.rollout.types import DecodingParams, RolloutRequest, check_prompt_alignment
from trainer.sync.policy import WeightSync

pytestmark = pytest.mark.vllm
PARAMS = DecodingParams(max_new_tokens=16)




def _requests(tok, n=5):
    out = []
    for i in range(n):
        msgs = ({"role": "user", "content": f"Detect every object.\nScene: shape number {i}"},)
        text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        out.append(RolloutRequest(f"q{i}", msgs, tuple(tok(text, add_special_tokens=False)["input_ids"])))
    return out


def _hf(model, tok, stop_ids, reqs):
    return [r.response_token_ids for r in HFRolloutEngine(model, tok.pad_token_id, stop_ids).generate(reqs, PARAMS)]


def _start_servers(model_dir, log_dir, n, extra=()):
    ports = [_free_port() for _ in range(n)]
    procs = []
    env = {**os.environ, "RM_TEST_KEY": "k3y", "VLLM_PLUGINS": ""}
    for port in ports:
        cmd = [sys.executable, "-m", "trainer", "serve", "--engine", "vllm", "--model", str(model_dir),
               "--port", str(port), "--max-model-len", "256", "--gpu-memory-utilization", "0.3", "--enforce-eager",
               "--kv-cache-bytes", str(64 * 2**20), "--dtype", "float32", "--api-key-env", "RM_TEST_KEY", *extra]
        with open(log_dir / f"serve-{port}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    return [f"http://127.0.0.1:{p}" for p in ports], procs


def _stop(procs):
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client(urls, procs, log_dir):
    from trainer.launch.health import wait_until_healthy

    def exited():
        dead = [(u, p.returncode) for u, p in zip(urls, procs) if p.poll() is not None]
        return f"vLLM server process(es) exited (url, code): {dead}" if dead else None

    t0 = time.perf_counter()
    try:
        # start-up takes ~60 s here (3 servers at once on 2 cores too); 900 s bounds a hang only, and a server
        # process that exits stops the wait at once
        wait_until_healthy(urls, timeout_s=900, interval_s=0.5, abort=exited)
        client = ServerRolloutEngine([ServerEndpoint(u, "k3y") for u in urls], timeout_s=300, transport="inband")
    except Exception:
        _stop(procs)
        for f in log_dir.glob("serve-*.log"):
            print(f.read_text()[-3000:])
        raise
    print(f"{len(urls)} vLLM rollout server(s) start-up (subprocesses, until healthy): {time.perf_counter() - t0:.1f}s")
    return client


@pytest.fixture(scope="module")
def vllm_server(tiny_text_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server")
    urls, procs = _start_servers(tiny_text_dir, log_dir, 1, ("--enable-lora", "--max-lora-rank", "8"))
    client = _client(urls, procs, log_dir)
    yield client
    client.close()
    _stop(procs)


@pytest.fixture(scope="module")
def hf_model(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32).eval()


def test_served_greedy_ids_match_hf(vllm_server, hf_model, tiny_tok, stop_ids):
    reqs = _requests(tiny_tok)
    got = vllm_server.generate(reqs, PARAMS)
    check_prompt_alignment(reqs, got)
    assert [r.response_token_ids for r in got] == _hf(hf_model, tiny_tok, stop_ids, reqs)
    keys = vllm_server.client.get(vllm_server.servers[0].base_url + "/get_model_state_keys/",
                                  headers=vllm_server.servers[0].headers()).json()["keys"]
    assert any("qkv_proj" in k for k in keys), "vLLM's runtime names (fused qkv) expected"


@pytest.mark.parametrize("top", [None, 2])
def test_logprobs_answer_like_swift_rollout(vllm_server, hf_model, top):
    """ms-swift's GRPO learner sends ``logprobs: true`` with every rollout (its importance-sampling correction) and
    reads ``choices[0].logprobs.content[i].logprob``: vLLM's processed log-probabilities, equal to the model's."""
    from tests.server.logprobs_check import check_logprobs_against_model, logprobs_body

    server = vllm_server.servers[0]
    msgs = [{"role": "user", "content": "Detect every object.\nScene: one red square"}]
    r = vllm_server.client.post(server.base_url + "/infer/", json=logprobs_body(msgs, top), headers=server.headers())
    assert r.status_code == 200, r.text
    check_logprobs_against_model(r.json()[0], hf_model, top, tol=1e-3)


def test_weight_sync_over_inband_transport(vllm_server, hf_model, tiny_tok, stop_ids):
    from peft import LoraConfig, get_peft_model

    reqs = _requests(tiny_tok)
    base = _hf(hf_model, tiny_tok, stop_ids, reqs)
    learner = copy.deepcopy(hf_model)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    want = _hf(learner, tiny_tok, stop_ids, reqs)
    assert want != base
    sync = WeightSync.for_model(vllm_server, learner, "auto")
    assert sync.decision.mode == "full"
    t0 = time.perf_counter()
    sync.ensure_fresh(learner, 0)
    print(f"full sync over HTTP: {time.perf_counter() - t0:.2f}s")
    assert [r.response_token_ids for r in vllm_server.generate(reqs, PARAMS)] == want

    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=8, target_modules="all-linear",
                                                                    init_lora_weights=False))
    lsync = WeightSync.for_model(vllm_server, peft_model, "adapter")
    lsync.ensure_fresh(peft_model, 1)
    lora_want = _hf(peft_model, tiny_tok, stop_ids, reqs)
    assert lora_want != base
    assert [r.response_token_ids for r in vllm_server.generate(reqs, PARAMS)] == lora_want


def test_three_servers_chunking_and_sync(tiny_text_dir, tmp_path, hf_model, tiny_tok, stop_ids):
    urls, procs = _start_servers(tiny_text_dir, tmp_path, 3)
    try:
        client = _client(urls, procs, tmp_path)
        reqs = _requests(tiny_tok, 7)
        got = client.generate(reqs, PARAMS)
        check_prompt_alignment(reqs, got)
        assert [r.extra["server"] for r in got] == [urls[0]] * 3 + [urls[1]] * 3 + [urls[2]]
        assert [r.response_token_ids for r in got] == _hf(hf_model, tiny_tok, stop_ids, reqs)
        assert client.generate([], PARAMS) == []
        learner = copy.deepcopy(hf_model)
        torch.manual_seed(11)
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        WeightSync.for_model(client, learner, "full").ensure_fresh(learner, 0)
        assert [r.response_token_ids for r in client.generate(reqs, PARAMS)] == _hf(learner, tiny_tok, stop_ids, reqs)
        client.close()
    finally:
        _stop(procs)


def test_nccl_transport_into_the_vllm_server_engine_both_receive_paths(tiny_text_dir, hf_model, tiny_tok, stop_ids,
                                                                       cpu_engine_kwargs):
    """The NCCL transport (torch backend, gloo wire on CPU) into ``VllmServerEngine``, over HTTP: the one-GPU path
    (the server process receives, stages, loads on ``finish_weights``) and the tensor-parallel path (each vLLM worker
    receives and stages through ``collective_rpc``; run here with TP=1, where the in-process worker is rank 0).
    Each path: a sync makes the served ids equal the learner's HF greedy ids; a NaN bucket is refused with 422
    naming the tensor, and the served ids stay those of the last good update."""
    from trainer.bench.async_rollouts import serve_engines
    from trainer.server.vllm_engine import VllmServerEngine
    from trainer.sync.weights import full_weights

    reqs = _requests(tiny_tok)
    engine = VllmServerEngine(tiny_text_dir, max_model_len=256, gpu_memory_utilization=0.3, dtype="float32",
                              engine_kwargs=cpu_engine_kwargs)
    try:
        with serve_engines([engine]) as urls:
            for worker_path, seed in ((False, 5), (True, 6)):
                engine._multi_worker = (lambda: True) if worker_path else (lambda: False)
                client = ServerRolloutEngine([ServerEndpoint(urls[0])], timeout_s=600, transport="nccl",
                                             nccl_backend="torch", group_port=_free_port())
                learner = copy.deepcopy(hf_model)
                torch.manual_seed(seed)
                with torch.no_grad():
                    for p in learner.parameters():
                        p.add_(torch.randn_like(p) * 0.2)
                want = _hf(learner, tiny_tok, stop_ids, reqs)
                client.sync_full(learner)
                assert not client.quarantined, (worker_path, client.quarantined)
                assert [r.response_token_ids for r in client.generate(reqs, PARAMS)] == want, worker_path
                bad = full_weights(learner)
                bad["model.layers.0.mlp.up_proj.weight"] = torch.full_like(bad["model.layers.0.mlp.up_proj.weight"],
                                                                           float("nan"))
                failed = client.transport().push_full(bad, [ServerEndpoint(urls[0])])
                msg = failed.get(urls[0], "")
                assert "refused (HTTP 422)" in msg and "model.layers.0.mlp.up_proj.weight" in msg, (worker_path, failed)
                assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == want, worker_path
                client.close()
    finally:
        engine.close()
