"""A rollout server stalled and then SIGKILLed in the middle of an NCCL-transport weight broadcast (CPU: the torch
backend over gloo, two real ``trainer serve --engine hf`` processes): the learner's push returns within
``vllm.sync.broadcast_timeout_s`` naming that key, the other server got the whole update, and the restarted server
is pushed the current weights through a fresh group. ``bounded_broadcast`` itself against a peer that never joins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trainer.rollout.server_client import ServerEndpoint
from trainer.sync.nccl import BroadcastTimeout, StoreGroup, TorchStatelessCommunicator, bounded_broadcast
from trainer.sync.transports import BROADCAST_TIMEOUT_KEY, NcclTransport
from trainer.sync.weights import full_weights, tensor_checksums

PEER = """
import sys, time
from trainer.sync.nccl import StoreGroup, TorchStatelessCommunicator
group = StoreGroup.create("127.0.0.1", int(sys.argv[1]), 0, 2, 60)
comm = TorchStatelessCommunicator(group)
print("joined", flush=True)
time.sleep(600)  # never takes part in the broadcast: a stalled peer
"""


def test_bounded_broadcast_aborts_a_broadcast_a_peer_never_joins(get_free_port):
    port = get_free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        group = StoreGroup.create("127.0.0.1", port, 1, 2, 60)
        comm = TorchStatelessCommunicator(group)
        assert peer.stdout.readline().strip() == "joined"
        # bounded by timeout_s: the error names the bound that ended the wait (the process group's own 1,800 s
        # would end it with no BroadcastTimeout, half an hour later)
        with pytest.raises(BroadcastTimeout, match=r"(within|after) 2 s"):
            bounded_broadcast(comm, torch.ones(64 * 2**20 // 4), timeout_s=2.0)  # 64 MiB: no socket buffer holds it
    finally:
        peer.kill()
        peer.wait(10)


def _served(http, url):
    return http.get(url + "/rm/weights_checksum/").json()["checksums"]


def test_server_killed_mid_broadcast_is_dropped_and_readmitted_with_current_weights(tiny_text_dir, get_free_port,
                                                                                    http, trainer_serve):
    from trainer.modeling.fixtures import build_tiny_model

    learner, _ = build_tiny_model("text", seed=1)
    tensors = full_weights(learner)
    ports = [get_free_port(), get_free_port()]
    args = ("--engine", "hf", "--model", str(tiny_text_dir))
    with trainer_serve(ports[0], *args) as (url_a, _), trainer_serve(ports[1], *args) as (url_b, proc_b):
        servers = [ServerEndpoint(url_a), ServerEndpoint(url_b)]
        transport = NcclTransport(servers, group_port=get_free_port(), timeout_s=60, bucket_bytes=64 * 2**20,
                                  backend="torch", broadcast_timeout_s=3.0)
        stopped = []

        def stall_b_mid_update(response):  # B has taken the bucket's metadata and waits for the broadcast
            if str(response.request.url).startswith(url_b) and response.request.url.path == "/update_flattened_params/":
                response.read()  # hooks run before the body is read: take it before the server stops
                os.kill(proc_b.pid, signal.SIGSTOP)
                stopped.append(time.monotonic())

        transport.client.event_hooks["response"].append(stall_b_mid_update)
        try:
            failed = transport.push_full(tensors, servers)
        finally:
            if stopped:  # a stopped process ignores SIGTERM: never leave it for the fixture's clean-up
                os.kill(proc_b.pid, signal.SIGKILL)
        assert stopped, "server B was stopped between its bucket's metadata and the broadcast"
        assert list(failed) == [url_b], failed
        assert BROADCAST_TIMEOUT_KEY in failed[url_b] and "=3 s" in failed[url_b]
        assert url_b not in transport.comms, "the failed server's communicator was dropped"
        want = tensor_checksums(tensors)
        assert {n: c for n, c in _served(http, url_a).items() if n in want} == want, "A got the whole update"
        proc_b.wait(30)  # the stalled server was killed mid-broadcast
        transport.client.event_hooks["response"].clear()

        with torch.no_grad():  # the learner trains on while B is down
            for p in learner.parameters():
                p.add_(0.01)
        tensors = full_weights(learner)
        assert transport.push_full(tensors, [servers[0]]) == {}, "the others keep syncing without B"
        with trainer_serve(ports[1], *args) as (url_b2, _):  # B restarted on its port: re-admitted
            assert url_b2 == url_b
            assert transport.push_full(tensors, servers) == {}
            want = tensor_checksums(tensors)
            for url in (url_a, url_b):
                assert {n: c for n, c in _served(http, url).items() if n in want} == want, url
        transport.close()
