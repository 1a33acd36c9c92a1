"""Quarantine and re-admission of rollout servers against real servers: a server is killed, its rollouts go to
the healthy ones, it restarts with base weights, is probed with a backed-off health check, gets the full current
weights pushed to it alone through ``WeightSync`` and only then serves again. In-band transport with in-process
servers; the NCCL transport with ``python -m trainer serve`` subprocesses and the torch communicator over gloo
(``sync.nccl_backend: torch``: the same group rendezvous, HTTP calls, buckets and broadcasts as NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import logging
import socket

import pytest
import torch

from tests.server.stall import INFER_TIMEOUT_S, Stall
from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
from trainer.rollout.types import DecodingParams, RolloutRequest
from trainer.server.scripted import tensors_digest
from trainer.sync.policy import WeightSync
from trainer.sync.weights import full_weights

PARAMS = DecodingParams(max_new_tokens=16)


class Clock:
    """A settable monotonic clock, so probe back-off is checked without sleeping."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(f"s{i}", ({"role": "user", "content": f"scene {i}"},), (1, 2, 3, i)) for i in range(n)]


def perturb(model: torch.nn.Module, seed: int) -> str:
    """Change the learner's weights; returns the version string servers report once they hold them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return tensors_digest(full_weights(model))[:16]


@pytest.fixture
def learner(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)


def test_killed_server_is_quarantined_then_resynced_and_readmitted(scripted_server, get_free_port, learner, http):
    port_b = get_free_port()
    with contextlib.ExitStack() as stack:
        url_a, eng_a = stack.enter_context(scripted_server())
        b = scripted_server(port=port_b)
        url_b, eng_b = b.__enter__()
        url_c, eng_c = stack.enter_context(scripted_server())
        clock = Clock()
        client = ServerRolloutEngine([ServerEndpoint(u) for u in (url_a, url_b, url_c)], timeout_s=10,
                                     transport="inband", readmit_after_s=5, readmit_max_interval_s=20, clock=clock)
        stack.callback(client.close)
        sync = WeightSync.for_model(client, learner, "full")
        w0 = tensors_digest(full_weights(learner))[:16]
        sync.ensure_fresh(learner, 0)
        assert [e.weights_version for e in (eng_a, eng_b, eng_c)] == [w0] * 3
        assert {r.extra["server"] for r in client.generate(requests(7), PARAMS)} == {url_a, url_b, url_c}

        b.__exit__(None, None, None)  # server B dies
        res = client.generate(requests(7), PARAMS)
        assert [r.sample_id for r in res] == [f"s{i}" for i in range(7)]
        assert {r.extra["server"] for r in res} == {url_a, url_c}
        assert {r.extra["weights_version"] for r in res} == {w0}
        assert client.quarantined == {url_b}

        w1 = perturb(learner, 1)
        clock.t = 4.9
        sync.ensure_fresh(learner, 1)  # not due yet: no probe
        assert (client.fleet.probe_of(url_b).due, client.fleet.probe_of(url_b).wait) == (5.0, 5.0)
        clock.t = 5.0
        sync.ensure_fresh(learner, 2)  # due, still down: the wait doubles
        probe = client.fleet.probe_of(url_b)
        assert client.quarantined == {url_b} and (probe.due, probe.wait) == (15.0, 10.0)
        assert eng_a.weights_version == eng_c.weights_version == w1, "healthy servers keep receiving pushes"
        assert [u["digest"][:16] for u in eng_a.updates] == [w0, w1, w1]

        b2 = stack.enter_context(scripted_server(port=port_b))  # restarted: a fresh process state, base weights
        url_b2, eng_b2 = b2
        assert url_b2 == url_b and eng_b2.weights_version == "initial"
        res = client.generate(requests(7), PARAMS)
        assert {r.extra["server"] for r in res} == {url_a, url_c} and eng_b2.generate_calls == 0, \
            "a restarted server must not serve before its re-sync"
        clock.t = 14.0
        sync.ensure_fresh(learner, 3)
        assert eng_b2.updates == [] and client.quarantined == {url_b}

        clock.t = 15.0
        sync.ensure_fresh(learner, 4)
        assert client.quarantined == set()
        assert [u["digest"][:16] for u in eng_b2.updates] == [w1], "exactly one full re-sync with the current weights"
        assert [r["server"] for r in client.readmissions] == [url_b]
        info = http.get(url_b + "/rm/info/").json()
        assert info["weights_version"] == w1
        assert [(u["transport"], u["kind"]) for u in info["updates"]] == [("inband", "full")]
        res = client.generate(requests(7), PARAMS)
        assert [r.extra["server"] for r in res] == [url_a] * 3 + [url_b] * 3 + [url_c]
        assert {r.extra["weights_version"] for r in res} == {w1}

        w2 = perturb(learner, 2)
        sync.ensure_fresh(learner, 5)
        assert [e.weights_version for e in (eng_a, eng_b2, eng_c)] == [w2] * 3, "re-admitted server gets pushes again"
        meta = client.metadata()
        assert meta["quarantined"] == [] and [r["server"] for r in meta["readmissions"]] == [url_b]
        assert meta["readmissions"][0]["mode"] == "full" and meta["readmissions"][0]["transport"] == "inband"


def test_failed_resync_keeps_the_server_quarantined(scripted_server, get_free_port, learner, caplog):
    port_b = get_free_port()
    with scripted_server() as (url_a, eng_a), scripted_server(port=port_b) as (url_b, eng_b):
        clock = Clock()
        client = ServerRolloutEngine([ServerEndpoint(url_a), ServerEndpoint(url_b)], timeout_s=10, transport="inband",
                                     readmit_after_s=1, clock=clock)
        sync = WeightSync.for_model(client, learner, "full")
        sync.ensure_fresh(learner, 0)
        stall = Stall(eng_b, calls={1})
        client.infer_timeout_s = INFER_TIMEOUT_S
        client.generate(requests(4), PARAMS)  # B stalls past the timeout
        assert client.quarantined == {url_b}
        stall.wait_finished()  # let B's stalled call drain

        def broken(tensors):
            raise RuntimeError("disk full")

        eng_b.load_full = broken
        clock.t = 1.0
        with caplog.at_level(logging.WARNING, logger="trainer.rollout.server_client"):
            sync.ensure_fresh(learner, 1)
        probe = client.fleet.probe_of(url_b)
        assert client.quarantined == {url_b} and (probe.due, probe.wait) == (3.0, 2.0)
        assert any(url_b in m and "re-sync failed" in m and "stays quarantined" in m and "disk full" in m
                   for m in caplog.messages), caplog.messages
        calls = eng_b.generate_calls
        assert {r.extra["server"] for r in client.generate(requests(4), PARAMS)} == {url_a}
        assert eng_b.generate_calls == calls

        del eng_b.load_full  # fixed
        clock.t = 3.0
        w1 = perturb(learner, 1)
        sync.ensure_fresh(learner, 2)
        assert client.quarantined == set() and eng_b.weights_version == w1
        assert {r.extra["server"] for r in client.generate(requests(4), PARAMS)} == {url_a, url_b}
        client.close()


def test_readmission_off_keeps_failed_servers_out(scripted_server, get_free_port, learner):
    with scripted_server() as (url_a, _), scripted_server(stalled=True) as (url_b, eng_b):
        client = ServerRolloutEngine([ServerEndpoint(url_a), ServerEndpoint(url_b)], timeout_s=10, transport="inband",
                                     infer_timeout_s=INFER_TIMEOUT_S, readmit_after_s=None)
        sync = WeightSync.for_model(client, learner, "full")
        client.generate(requests(2), PARAMS)
        assert client.quarantined == {url_b}
        eng_b.stall.wait_finished()
        sync.ensure_fresh(learner, 0)
        assert client.quarantined == {url_b} and eng_b.updates == []
        client.close()


def test_push_failure_on_one_server_quarantines_it_and_completes_on_the_others(scripted_server, learner):
    with scripted_server() as (url_a, eng_a), scripted_server() as (url_b, eng_b):
        client = ServerRolloutEngine([ServerEndpoint(url_a), ServerEndpoint(url_b)], timeout_s=10, transport="inband",
                                     readmit_after_s=30)

        def broken(tensors):
            raise RuntimeError("out of memory")

        eng_b.load_full = broken
        sync = WeightSync.for_model(client, learner, "full")
        sync.ensure_fresh(learner, 0)
        assert client.quarantined == {url_b}
        assert eng_a.weights_version == tensors_digest(full_weights(learner))[:16]
        assert {r.extra["server"] for r in client.generate(requests(3), PARAMS)} == {url_a}
        eng_a.load_full = broken
        from trainer.sync.transports import WeightTransportError

        with pytest.raises(WeightTransportError, match=rf"{url_a}.*out of memory"):
            sync.ensure_fresh(learner, 1)  # every active server failed: a config problem, not a fault to absorb
        client.close()


# --- NCCL transport (torch communicator over gloo, server subprocesses) ------------------------------------------

def _free_pair() -> int:
    """A port p with p and p + 1 free (group ports of servers 0 and 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def test_nccl_transport_drops_a_dead_server_and_readmits_it_with_a_fresh_communicator(get_free_port, learner, http,
                                                                                     trainer_serve):
    def served_scripted(port):
        return trainer_serve(port, "--engine", "scripted")

    port_a, port_b = get_free_port(), get_free_port()
    with served_scripted(port_a) as (url_a, _), contextlib.ExitStack() as stack:
        url_b, proc_b = stack.enter_context(served_scripted(port_b))
        clock = Clock()
        client = ServerRolloutEngine([ServerEndpoint(url_a), ServerEndpoint(url_b)], timeout_s=30, transport="nccl",
                                     group_port=_free_pair(), bucket_bytes=256 * 2**10, readmit_after_s=1,
                                     nccl_backend="torch", clock=clock)
        sync = WeightSync.for_model(client, learner, "full")
        w0 = tensors_digest(full_weights(learner))[:16]
        sync.ensure_fresh(learner, 0)
        transport = client._transport
        assert transport.name == "nccl" and set(transport.comms) == {url_a, url_b}
        for url in (url_a, url_b):
            info = http.get(url + "/rm/info/").json()
            assert info["weights_version"] == w0
            assert {u["endpoint"] for u in info["updates"]} == {"update_flattened_params"}
            assert len(info["updates"]) > 1, "the tiny model spans several 256 KiB buckets"

        proc_b.kill()
        proc_b.wait(10)
        res = client.generate(requests(4), PARAMS)
        assert {r.extra["server"] for r in res} == {url_a} and client.quarantined == {url_b}
        assert [s.base_url for s in client.fleet.healthy()] == [url_a] and set(transport.comms) == {url_a}, \
            "the dead server must leave the collective group"

        w1 = perturb(learner, 1)
        sync.ensure_fresh(learner, 1)  # not due: pushes to A only, no hang on B's dead communicator
        assert http.get(url_a + "/rm/info/").json()["weights_version"] == w1

        stack.close()
        with served_scripted(port_b) as (url_b2, _):
            assert http.get(url_b2 + "/rm/info/").json()["weights_version"] == "initial"
            clock.t = 1.0
            w2 = perturb(learner, 2)
            sync.ensure_fresh(learner, 2)
            assert client.quarantined == set() and set(transport.comms) == {url_a, url_b}
            for url in (url_a, url_b):
                assert http.get(url + "/rm/info/").json()["weights_version"] == w2
            res = client.generate(requests(4), PARAMS)
            assert [r.extra["server"] for r in res] == [url_a] * 2 + [url_b] * 2
            assert {r.extra["weights_version"] for r in res} == {w2}
            assert client.readmissions[0]["transport"] == "nccl"
            client.close()
