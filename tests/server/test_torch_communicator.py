"""The pure-torch NCCL-transport backend (``sync.nccl_backend: torch``) on CPU: ``TorchStatelessCommunicator`` over
gloo, learner-side ``NcclTransport`` against a real ``python -m trainer serve --engine hf`` subprocess."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from trainer.rollout.server_client import ServerEndpoint
from trainer.sync.transports import (
    NcclTransport,
    StoreGroup,
    TorchStatelessCommunicator,
    WeightTransportError,
    join_group,
    resolve_nccl_backend,
)
from trainer.sync.weights import full_weights, tensor_checksum, tensor_checksums


def test_torch_communicator_broadcasts_over_gloo_without_the_default_group(get_free_port):
    import torch.distributed as dist

    port = get_free_port()
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            comm = join_group("torch", "127.0.0.1", port, r, 3, torch.device("cpu"), store_timeout=30)
            group = comm.group
            assert isinstance(group, StoreGroup) and isinstance(comm, TorchStatelessCommunicator)
            for i in range(3):  # the last rank sends, as the learner does
                t = torch.arange(7, dtype=torch.bfloat16) * (i + 1) if r == 2 else torch.zeros(7, dtype=torch.bfloat16)
                comm.broadcast(t, src=2)
                group.barrier()
            got[r] = t
            assert group.broadcast_obj({"from": r} if r == 0 else None, src=0) == {"from": 0}
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not dist.is_initialized(), "the group must not create the default process group"
    for r in range(3):
        assert torch.equal(got[r], torch.arange(7, dtype=torch.bfloat16) * 3)


def test_tensor_checksum_is_bit_exact():
    a = torch.randn(1000, dtype=torch.bfloat16)
    b = a.clone()
    assert tensor_checksum(a) == tensor_checksum(b)
    b.view(torch.int16)[500] ^= 1  # one flipped bit
    assert tensor_checksum(a) != tensor_checksum(b)
    assert tensor_checksum(torch.arange(3, dtype=torch.uint8)) != tensor_checksum(torch.arange(3, dtype=torch.uint8).flip(0))


def test_nccl_backend_config_is_validated():
    from pydantic import ValidationError

    from trainer.rollout.vllm_schema import VllmSyncConfig

    assert VllmSyncConfig().nccl_backend == "auto"
    assert VllmSyncConfig(transport="nccl", nccl_backend="torch").nccl_backend == "torch"
    with pytest.raises(ValidationError, match="only applies to sync.transport nccl"):
        VllmSyncConfig(transport="inband", nccl_backend="torch")
    with pytest.raises(ValidationError):
        VllmSyncConfig(nccl_backend="gloo")
    assert resolve_nccl_backend("torch") == "torch"
    with pytest.raises(ValueError, match="unknown NCCL backend"):
        resolve_nccl_backend("mpi")


def _served_checksums(http: httpx.Client, url: str) -> dict[str, str]:
    resp = http.get(url + "/rm/weights_checksum/")
    assert resp.status_code == 200, resp.text
    return resp.json()["checksums"]


def test_torch_backend_nccl_transport_syncs_a_real_hf_server_over_gloo(tiny_text_dir, get_free_port, http,
                                                                        trainer_serve):
    from trainer.modeling.fixtures import build_tiny_model

    learner, _ = build_tiny_model("text", seed=1)  # the server loads seed 0: every weight differs at first
    tensors = full_weights(learner)
    want = tensor_checksums(tensors)
    with trainer_serve(get_free_port(), "--engine", "hf", "--model", str(tiny_text_dir)) as (url, _):
        info = http.get(url + "/rm/info/").json()
        assert "torch-gloo" in info["nccl_backends"] and "torch-nccl" not in info["nccl_backends"]  # CPU server
        refused = http.post(url + "/init_communicator/",
                            json={"host": "127.0.0.1", "port": get_free_port(), "world_size": 2, "backend": "torch-nccl"})
        assert refused.status_code == 400 and "torch-nccl" in refused.text

        before = _served_checksums(http, url)
        assert set(want) <= set(before)
        assert all(before[n] != want[n] for n in want if "norm" not in n)  # norms start at ones in both

        transport = NcclTransport([ServerEndpoint(url)], group_port=get_free_port(), timeout_s=60,
                                  bucket_bytes=256 * 2**10, backend="torch")
        assert transport.backend == "torch" and transport.device.type == "cpu"
        assert transport.push_full(tensors, [ServerEndpoint(url)]) == {}
        assert isinstance(transport.comms[url], TorchStatelessCommunicator)
        stats = transport.last_push
        assert stats["buckets"] > 1, "the tiny model spans several 256 KiB buckets"
        assert stats["bytes"] >= sum(t.numel() * t.element_size() for t in tensors.values())
        after = _served_checksums(http, url)
        assert {n: after[n] for n in want} == want, "the served weights must equal the learner's bit for bit"
        updates = http.get(url + "/rm/info/").json()["updates"]
        assert [u["endpoint"] for u in updates] == ["update_flattened_params"] * stats["buckets"]

        with torch.no_grad():  # a second sync over the same communicator: a training step's change arrives
            for p in learner.parameters():
                p.add_(0.01)
        tensors = full_weights(learner)
        assert transport.push_full(tensors, [ServerEndpoint(url)]) == {}
        assert {n: c for n, c in _served_checksums(http, url).items() if n in tensors} == tensor_checksums(tensors)
        transport.close()


def test_torch_backend_refuses_a_server_without_it(scripted_server, get_free_port):
    """A server that does not list the backend (as a ``swift rollout`` server, which has no /rm/info/) is refused
    with a clear error instead of a rendezvous that never completes."""
    from trainer.server import app as app_module

    with scripted_server() as (url, _):
        original = app_module.nccl_backends
        app_module.nccl_backends = lambda: ["pynccl"]
        try:
            transport = NcclTransport([ServerEndpoint(url)], group_port=get_free_port(), timeout_s=10, backend="torch")
            with pytest.raises(WeightTransportError, match="offers NCCL backends"):
                transport.connect(ServerEndpoint(url))
            assert "offers NCCL backends" in transport.push_full({}, [ServerEndpoint(url)])[url]
        finally:
            app_module.nccl_backends = original
