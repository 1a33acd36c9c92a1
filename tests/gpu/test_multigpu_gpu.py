"""Several learner ranks and servers on several GPUs (deselected on CPU; run on a machine with several GPUs and vLLM installed):
``python -m pytest -m gpu tests/gpu/test_multigpu_gpu.py``.

A: a step's records decoded in one call and trained as every row they fill, on several ranks (ledger of every rank:
each sample once). B: colocate under torchrun at 1, 2 and 4 ranks, vLLM TP 1 per rank and a TP group, sleep levels
1 and 2, full and LoRA. D: a vLLM server stalled, then SIGKILLed, in the middle of an NCCL broadcast: the push ends
within ``vllm.sync.broadcast_timeout_s`` naming it, and the restarted server gets the current weights. Every case runs
through the product's own entry points (``trainer serve``, ``torch.distributed.run -m trainer train``) via the
benchmark runner (``trainer.bench.runner.run_variant``) on a tiny table built here."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from trainer.bench.runner import run_variant, save_model
from trainer.bench.table import ServerSettings, Table, Variant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs: run on a multi-GPU device machine")]

GPUS = torch.cuda.device_count()
REPO = Path(__file__).resolve().parents[2]
#: the tiny Qwen3-VL, 16 records a step, 3 steps, 64 new tokens, 2k rows, vLLM colocate at 0.2 of each GPU
BASE = {
    "model": {"torch_dtype": "bfloat16"},
    "data": {"synthetic": {"seed": 0, "min_objects": 1, "max_objects": 3, "image_size": 64}},
    "training": {"max_steps": 3, "records_per_step": 16, "learning_rate": 1e-5, "logging_steps": 1, "seed": 0,
                 "disable_tqdm": True, "report_to": ["jsonl"], "save_steps": 0, "bf16": True, "packing": True,
                 "packing_length": 2048, "packing_buffer": 64, "gradient_checkpointing_policy": "full"},
    "custom": {"extra": {"rollout_matching": {
        "rollout_backend": "vllm", "rollout_generate_batch_size": 16,
        "decoding": {"max_new_tokens": 64, "temperature": 0.0},
        "vllm": {"mode": "colocate", "max_model_len": 4096, "sleep_level": 2, "tensor_parallel_size": 1,
                 "gpu_memory_utilization": 0.2}}}},
}
SERVER_ASYNC = {"custom": {"extra": {"rollout_matching": {"vllm": {
    "mode": "server", "sync": {"mode": "full"}, "max_model_len": None, "sleep_level": 0,
    "server": {"timeout_s": 300, "infer_timeout_s": 900, "async_rollouts": {"enabled": True, "max_staleness_steps": 1}}}}}}}


def _run(name: str, model_dir: Path, tmp_path: Path, learner_gpus: int = 1, servers: int = 0, **config) -> dict:
    """One variant of a one-variant table through the benchmark runner."""
    variant = Variant(name=name, learner_gpus=learner_gpus, servers=servers, config=config)
    table = Table(model="tiny", base=BASE, variants=[variant], timeout_s=240.0,
                  server=ServerSettings(gpu_memory_utilization=0.3))
    return run_variant(table, variant, REPO / "benchmarks", model_dir, tmp_path, cuda=True)


def _need(n: int) -> None:
    if GPUS < n:
        pytest.skip(f"needs {n} GPUs, this machine has {GPUS}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model("tiny", tmp_path_factory.mktemp("model"), cuda=True)


def _ok(rec: dict) -> dict:
    assert "error" not in rec, (rec.get("error"), rec.get("learner_log_tail", "")[-3000:])
    assert rec["ledger"]["duplicated"] == 0 and rec["ledger"]["rows"] > 0
    assert rec["trained_samples_per_s"] > 0
    return rec


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_step_trains_every_row_on_every_rank(model_dir, tmp_path, ranks):
    _need(ranks)
    # a step's 16 records fill several 512-token rows
    rec = _ok(_run(f"colocate-{ranks}", model_dir, tmp_path, ranks, training={"packing_length": 512}))
    assert rec["means"]["batch/rows_per_step"] > 1
    assert rec["means"]["rollout/samples"] == 16 / ranks, "each rank decoded its share of the step at once"


@pytest.mark.parametrize(("ranks", "tp", "sleep", "tuner"), [
    (1, 1, 2, "full"), (1, 1, 1, "lora"), (2, 1, 2, "lora"), (2, 2, 2, "full"), (4, 1, 1, "full"), (4, 4, 2, "full"),
])
def test_colocate_under_torchrun(model_dir, tmp_path, ranks, tp, sleep, tuner):
    _need(ranks)
    config = {"custom": {"extra": {"rollout_matching": {"vllm": {"sleep_level": sleep, "tensor_parallel_size": tp}}}}}
    if tuner != "full":
        config["tuner"] = {"train_type": tuner, "lora_rank": 16, "lora_alpha": 32}
    _ok(_run(f"colocate-{ranks}-tp{tp}", model_dir, tmp_path, ranks, **config))


def test_server_layout_on_two_gpus(model_dir, tmp_path):
    _need(2)
    rec = _ok(_run("1v1-async", model_dir, tmp_path, 1, 1, **SERVER_ASYNC))
    assert rec["means"]["rollout/staleness_mean"] <= 1


def test_server_layout_with_two_learner_ranks(model_dir, tmp_path):
    _need(4)
    rec = _ok(_run("2v2-async", model_dir, tmp_path, 2, 2, **SERVER_ASYNC))
    assert rec["means"]["rollout/staleness_mean"] <= 1


def test_vllm_server_killed_mid_broadcast(model_dir, tmp_path):
    """vLLM servers on every GPU but the last (at most two) and this process as the learner on the last GPU (NCCL
    refuses two ranks of one communicator on one device). The last server is stalled mid-broadcast, then killed:
    only its push fails, naming the timeout's key, within the timeout; the other server (3+ GPUs) gets the update;
    the restarted server is re-admitted with the current weights."""
    _need(2)
    import httpx
    from transformers import AutoModelForImageTextToText

    from trainer.bench.processes import stop_group
    from trainer.bench.runner import _popen
    from trainer.launch.health import wait_until_healthy
    from trainer.launch.ports import listen_port, listen_ports
    from trainer.rollout.server_client import ServerEndpoint
    from trainer.sync.transports import BROADCAST_TIMEOUT_KEY, NcclTransport
    from trainer.sync.weights import full_weights, tensor_checksum

    def start(i: int, port: int):
        argv = ["python3", "-m", "trainer", "serve", "--engine", "vllm", "--model", str(model_dir), "--port", str(port),
                "--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--enforce-eager"]
        return _popen(argv, tmp_path / f"server-{i}.log", [i])

    n = min(2, GPUS - 1)
    ports = listen_ports(n)
    procs = [start(i, p) for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    victim = n - 1
    try:
        wait_until_healthy(urls, 600)
        device = n
        torch.cuda.set_device(device)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
        tensors = full_weights(model)
        servers = [ServerEndpoint(u) for u in urls]
        transport = NcclTransport(servers, group_port=listen_port(), timeout_s=120, broadcast_timeout_s=10.0,
                                  device=device)
        assert transport.push_full(tensors, servers) == {}
        stopped = []

        def stall(response):
            if str(response.request.url).startswith(urls[victim]) and \
                    response.request.url.path == "/update_flattened_params/":
                response.read()
                os.kill(procs[victim].pid, signal.SIGSTOP)
                stopped.append(1)

        transport.client.event_hooks["response"].append(stall)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        tensors = full_weights(model)
        t0 = time.monotonic()
        try:
            failed = transport.push_full(tensors, servers)
        finally:
            if stopped:
                os.killpg(procs[victim].pid, signal.SIGKILL)
        took = time.monotonic() - t0
        assert stopped and list(failed) == [urls[victim]] and BROADCAST_TIMEOUT_KEY in failed[urls[victim]], failed
        assert took < 120, took
        transport.client.event_hooks["response"].clear()
        procs[victim].wait(30)
        procs[victim] = start(victim, ports[victim])
        wait_until_healthy([urls[victim]], 600)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        tensors = full_weights(model)
        assert transport.push_full(tensors, servers) == {}, "the restarted server is re-admitted"
        with httpx.Client(timeout=60) as http:
            sums = [http.get(u + "/rm/weights_checksum/").json()["checksums"] for u in urls]
        assert all(s == sums[0] for s in sums), "every server holds the same weights"
        norm = next(k for k in tensors if k.endswith("language_model.norm.weight"))
        assert tensor_checksum(tensors[norm]) in set(sums[victim].values()), "the restarted server holds the current weights"
        print(f"GPU_D_RESULT stalled push failed in {took:.1f} s naming {BROADCAST_TIMEOUT_KEY}; "
              f"{n} server(s), learner on GPU {device}")
        transport.close()
    finally:
        for p in procs:
            stop_group(p, grace_s=30.0)
