"""In-band updates through a shared directory (``sync.shm_dir`` / ``serve --shm-dir``, ``trainer.sync.shm_staging``):
the hf server engine serves exactly the learner's weights afterwards, bad updates are refused with the old weights
serving, and every way the two sides can disagree (no shared directory, a path instead of a name, a size that
does not match, a server without ``--shm-dir``) fails with a message that says what to change."""

from __future__ import annotations

import copy
import subprocess
import sys

import httpx
import pytest
import torch

from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
from trainer.sync.shm_staging import SHM_PATH, ShmReader, ShmStaging, ShmUpdateError
from trainer.sync.transports import InbandTransport
from trainer.sync.weights import full_weights, tensor_checksums

BAD = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def hf_shm(tiny_text_dir, serve, shm_dir):
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    engine = HFServerEngine(tiny_text_dir)
    with serve(create_app(engine, shm_dir=str(shm_dir))) as url:
        yield url, engine


def _perturbed(engine, seed: int):
    model = copy.deepcopy(engine.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01)
    return model


def _served(url: str) -> dict[str, str]:
    return httpx.get(url + "/rm/weights_checksum/", timeout=30).json()["checksums"]


def test_a_shared_directory_update_serves_exactly_the_learners_weights(hf_shm, shm_dir):
    url, engine = hf_shm
    client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=30, transport="inband", shm_dir=str(shm_dir))
    for seed in (1, 2):  # the second push reuses the staging file
        learner = _perturbed(engine, seed)
        client.sync_full(learner)
        assert not client.quarantined
        assert _served(url) == tensor_checksums(engine.model.state_dict())
        want = full_weights(learner)
        got = engine.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in got), "the served weights are not the learner's"
    transport = client.transport()
    staged = transport.shm.path
    assert staged.parent == shm_dir and staged.is_file()
    update = httpx.get(url + "/rm/info/", timeout=30).json()["updates"][-1]
    assert update["endpoint"] == "rm/update_weights_shm" and update["bytes"] == transport.last_push["bytes"]
    client.close()
    assert not staged.exists(), "the staging file outlived the transport"


def test_a_bad_shared_directory_update_is_refused_and_the_old_weights_keep_serving(hf_shm, shm_dir):
    url, engine = hf_shm
    before = _served(url)
    bad = full_weights(engine.model)
    bad = {k: v.clone() for k, v in bad.items()}
    bad[BAD][0, 0] = float("nan")
    transport = InbandTransport(timeout_s=30, shm_dir=str(shm_dir))
    failed = transport.push_full(bad, [ServerEndpoint(url)])
    assert "refused (HTTP 422)" in failed[url] and repr(BAD) in failed[url], failed
    assert _served(url) == before

    def post(file, nbytes):
        return httpx.post(url + SHM_PATH, params={"kind": "full"}, json={"file": file, "bytes": nbytes}, timeout=30)

    size = transport.shm.path.stat().st_size
    resp = post("../" + transport.shm.name, size)
    assert resp.status_code == 400 and "not a staging file name" in resp.json()["detail"], resp.text
    resp = post(transport.shm.name, size + 8)
    assert resp.status_code == 400 and "fewer than the" in resp.json()["detail"], resp.text
    resp = post("rm-update-elsewhere.safetensors", size)
    assert resp.status_code == 400 and "not found in --shm-dir" in resp.json()["detail"], resp.text
    assert _served(url) == before
    transport.close()


def test_learner_and_server_without_a_common_directory_say_so(hf_shm, serve, tiny_text_dir, tmp_path):
    url, engine = hf_shm
    elsewhere = tmp_path / "learner-only"
    elsewhere.mkdir()
    transport = InbandTransport(timeout_s=30, shm_dir=str(elsewhere))
    failed = transport.push_full(full_weights(engine.model), [ServerEndpoint(url)])
    assert "not found in --shm-dir" in failed[url] and "mount the same tmpfs" in failed[url], failed

    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    with serve(create_app(ScriptedEngine(tiny_text_dir))) as plain_url:
        failed = transport.push_full(full_weights(engine.model), [ServerEndpoint(plain_url)])
        assert "not started with --shm-dir" in failed[plain_url], failed
    transport.close()
    with pytest.raises(ShmUpdateError, match="not a directory"):
        ShmStaging(tmp_path / "missing")


def test_the_reader_keeps_one_mapping_that_sees_each_rewrite_and_follows_a_grown_file(tmp_path):
    from trainer.sync.wire import encode

    staging, reader = ShmStaging(tmp_path), ShmReader(tmp_path)
    first = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    blob = encode(first, None, staging.allocate)
    got, _ = reader.read(staging.name, len(blob))
    assert all(torch.equal(got[k], first[k]) for k in first)
    kept = reader._kept
    second = {k: v * 3 for k, v in first.items()}  # same size: rewritten in place, read through the kept mapping
    blob = encode(second, None, staging.allocate)
    got, _ = reader.read(staging.name, len(blob))
    assert reader._kept is kept and all(torch.equal(got[k], second[k]) for k in second)
    on_meta, _ = reader.read(staging.name, len(blob), torch.device("meta"))
    assert {k: (v.device.type, v.shape, v.dtype) for k, v in on_meta.items()} == \
        {k: ("meta", v.shape, v.dtype) for k, v in second.items()}

    old_name = staging.name
    larger = {**second, "c": torch.randn(4096)}  # a larger update moves to a new file; the old one is removed
    blob = encode(larger, None, staging.allocate)
    assert staging.name != old_name and not (tmp_path / old_name).exists()
    with pytest.raises(ShmUpdateError, match="not found in --shm-dir"):
        reader.read(old_name, 64)
    got, _ = reader.read(staging.name, len(blob))
    assert reader._kept is not kept and all(torch.equal(got[k], larger[k]) for k in larger)
    smaller = {"a": first["a"] + 1}  # a smaller one reuses the larger file: only its declared bytes are read
    blob = encode(smaller, None, staging.allocate)
    got, _ = reader.read(staging.name, len(blob))
    assert list(got) == ["a"] and torch.equal(got["a"], smaller["a"])
    reader.close()
    assert reader._kept is None
    staging.close()
    assert not list(tmp_path.iterdir()), "the staging file outlived close()"


def test_config_and_cli_refuse_a_shm_dir_that_cannot_work(tmp_path):
    from trainer.config.vllm import VllmSyncConfig

    with pytest.raises(ValueError, match="sync.shm_dir: /dev/shm only applies to sync.transport inband"):
        VllmSyncConfig(transport="nccl", shm_dir="/dev/shm")
    assert VllmSyncConfig(transport="inband", shm_dir="/dev/shm").shm_dir == "/dev/shm"
    out = subprocess.run([sys.executable, "-m", "trainer", "serve", "--engine", "scripted", "--shm-dir",
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--shm-dir" in out.stderr and "not a directory" in out.stderr, out.stderr[-2000:]


def test_a_smaller_update_after_a_larger_one_reads_only_its_own_bytes(tiny_text_dir, serve, tmp_path):
    """A smaller update reuses the larger staging file: an adapter (small) after a full update (large) must still load."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine, tensors_digest
    from trainer.sync.weights import adapter_weights

    engine = ScriptedEngine(tiny_text_dir, enable_lora=True)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32), LoraConfig(r=4, target_modules=["q_proj"],
                                                                      init_lora_weights=False))
    with serve(create_app(engine, shm_dir=str(tmp_path))) as url:
        transport = InbandTransport(timeout_s=30, shm_dir=str(tmp_path))
        assert transport.push_full(full_weights(peft_model), [ServerEndpoint(url)]) == {}
        adapter = adapter_weights(peft_model)
        assert transport.push_adapter(adapter, [ServerEndpoint(url)]) == {}
        assert transport.shm.path.stat().st_size > transport.last_push["bytes"]
        transport.close()
    assert [u["kind"] for u in engine.updates] == ["full", "adapter"]
    assert engine.updates[-1]["digest"] == tensors_digest(adapter.tensors)
