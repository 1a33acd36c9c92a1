"""Merged full syncs to rollout servers send the frozen weights once per server admission: the first sync and a
re-admission carry every weight, later syncs only ``changing_keys`` (LoRA-merged weights, trainable parameters), and
the servers still serve exactly the learner's weights. In-process HF servers, in-band transport, a real peft LoRA."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import torch

from trainer.config.schema import TunerConfig
from trainer.modeling.loading import apply_tuner
from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
from trainer.sync.weights import changing_keys, full_weights


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def two_servers(tiny_text_dir, serve):
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    engines = [HFServerEngine(tiny_text_dir), HFServerEngine(tiny_text_dir)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve(create_app(e))) for e in engines]
        yield list(zip(urls, engines))


@pytest.fixture
def lora_learner(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
    return apply_tuner(model, TunerConfig(train_type="lora", lora_rank=4), multimodal=False)


def step(model, seed: int) -> None:
    """What an optimizer step changes on a LoRA learner: the adapter factors only."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def last_update(url: str) -> dict:
    return httpx.get(url + "/rm/info/", timeout=30).json()["updates"][-1]


def serves_learner(engine, learner) -> bool:
    want = full_weights(learner)
    got = engine.model.state_dict()
    assert set(got) <= set(want), sorted(set(got) - set(want))
    return all(torch.equal(got[k], want[k]) for k in got)


def test_frozen_weights_go_once_per_admission_and_the_servers_serve_the_learner(two_servers, lora_learner,
                                                                               tiny_text_dir):
    (url_a, eng_a), (url_b, eng_b) = two_servers
    everything = full_weights(lora_learner)
    changing = changing_keys(lora_learner)
    assert 0 < len(changing) < len(everything)
    assert all("proj" in k for k in changing), sorted(changing)[:5]  # the LoRA-targeted linears, nothing else
    clock = Clock()
    client = ServerRolloutEngine([ServerEndpoint(url_a), ServerEndpoint(url_b)], timeout_s=30, transport="inband",
                                 readmit_after_s=1.0, clock=clock)
    try:
        step(lora_learner, 1)
        client.sync_full(lora_learner)
        for url, eng in two_servers:
            assert last_update(url)["num_tensors"] == len(everything)
            assert serves_learner(eng, lora_learner)
        step(lora_learner, 2)
        client.sync_full(lora_learner)
        assert client.last_full_push["whole_to"] == [] and client.last_full_push["keys"] == len(changing)
        for url, eng in two_servers:
            assert last_update(url)["num_tensors"] == len(changing)
            assert serves_learner(eng, lora_learner), "a partial push left a server off the learner's weights"
        # server b fails and comes back as a fresh process would: base weights from its checkpoint
        client.fleet.quarantine(url_b, "test: killed")
        eng_b.model.load_state_dict(type(eng_b.model).from_pretrained(tiny_text_dir).state_dict())
        assert not serves_learner(eng_b, lora_learner)
        clock.t += 5.0
        step(lora_learner, 3)
        client.sync_full(lora_learner)
        assert url_b not in client.quarantined
        assert last_update(url_a)["num_tensors"] == len(changing)
        assert last_update(url_b)["num_tensors"] == len(everything), "a re-admitted server got only the changes"
        assert serves_learner(eng_a, lora_learner) and serves_learner(eng_b, lora_learner)
        step(lora_learner, 4)  # the re-admitted server's identity is read at its next sync, which is whole again
        client.sync_full(lora_learner)
        assert [last_update(u)["num_tensors"] for u in (url_a, url_b)] == [len(changing), len(everything)]
        step(lora_learner, 5)
        client.sync_full(lora_learner)
        assert [last_update(u)["num_tensors"] for u in (url_a, url_b)] == [len(changing)] * 2
        assert serves_learner(eng_a, lora_learner) and serves_learner(eng_b, lora_learner)
    finally:
        client.close()


def test_a_server_restarted_between_syncs_without_any_failure_gets_every_weight_again(tiny_text_dir, serve,
                                                                                      get_free_port, lora_learner):
    """The learner saw no failed request (nothing was sent to the server while it was down), but the process that
    answers now is a new one, with its checkpoint's weights: the next push to it is whole."""
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    everything, changing = full_weights(lora_learner), changing_keys(lora_learner)
    engine, port = HFServerEngine(tiny_text_dir), get_free_port()
    client = None
    try:
        with serve(create_app(engine), port) as url:
            client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=30, transport="inband")
            for seed in (1, 2):
                step(lora_learner, seed)
                client.sync_full(lora_learner)
            assert last_update(url)["num_tensors"] == len(changing)
            first_boot = httpx.get(url + "/rm/identity/", timeout=30).json()["boot_id"]
        engine = HFServerEngine(tiny_text_dir)  # a fresh process: the checkpoint's weights, a new identity
        with serve(create_app(engine), port) as again:
            assert again == url and httpx.get(url + "/rm/identity/", timeout=30).json()["boot_id"] != first_boot
            assert not serves_learner(engine, lora_learner)
            step(lora_learner, 3)
            client.sync_full(lora_learner)
            assert url not in client.quarantined and client.last_full_push["whole_to"] == [url]
            assert last_update(url)["num_tensors"] == len(everything)
            assert serves_learner(engine, lora_learner), "the restarted server kept its checkpoint's frozen weights"
            step(lora_learner, 4)
            client.sync_full(lora_learner)
            assert last_update(url)["num_tensors"] == len(changing) and serves_learner(engine, lora_learner)
    finally:
        if client is not None:
            client.close()


def test_a_server_without_an_identity_endpoint_is_trusted_by_its_failures(two_servers, lora_learner, monkeypatch):
    """``swift rollout`` has no ``/rm/identity/``: it reads as ``None`` (its restarts break the NCCL group, and the
    failed push quarantines it), so frozen-once still applies to it."""
    from trainer.rollout import server_fleet

    (url_a, eng_a), _ = two_servers
    real_get = httpx.Client.get

    def no_identity(self, url, *args, **kwargs):
        if str(url).endswith("/rm/identity/"):
            return httpx.Response(404, request=httpx.Request("GET", url))
        return real_get(self, url, *args, **kwargs)

    monkeypatch.setattr(server_fleet.httpx.Client, "get", no_identity)
    client = ServerRolloutEngine([ServerEndpoint(url_a)], timeout_s=30, transport="inband")
    try:
        assert client.fleet.boot_ids([url_a]) == {url_a: None}
        for seed in (1, 2):
            step(lora_learner, seed)
            client.sync_full(lora_learner)
        assert last_update(url_a)["num_tensors"] == len(changing_keys(lora_learner))
        assert serves_learner(eng_a, lora_learner)
    finally:
        client.close()


def test_resend_frozen_and_base_syncs_send_everything(two_servers, lora_learner):
    (url_a, _), _ = two_servers
    everything = full_weights(lora_learner)
    client = ServerRolloutEngine([ServerEndpoint(url_a)], timeout_s=30, transport="inband", resend_frozen=True)
    try:
        for seed in (1, 2):
            step(lora_learner, seed)
            client.sync_full(lora_learner)
            assert last_update(url_a)["num_tensors"] == len(everything)
    finally:
        client.close()
    client = ServerRolloutEngine([ServerEndpoint(url_a)], timeout_s=30, transport="inband")
    try:
        for _ in range(2):  # adapter mode's base: whole every time it is asked for
            client.sync_full(lora_learner, merge_adapter=False)
            assert last_update(url_a)["num_tensors"] == len(full_weights(lora_learner, merge_adapter=False))
    finally:
        client.close()


def test_changing_keys_of_a_full_fine_tune_with_a_frozen_vision_tower():
    from trainer.modeling.fixtures import build_tiny_model

    model, _ = build_tiny_model("vl", seed=0)
    model = apply_tuner(model, TunerConfig(train_type="full", freeze_vit=True, freeze_aligner=True), multimodal=True)
    keys = changing_keys(model)
    everything = full_weights(model)
    assert keys <= set(everything)
    assert not any(".visual." in f".{k}" for k in keys), "frozen vision weights counted as changing"
    assert any("language_model" in k or k.startswith("model.layers") for k in keys)
    assert {k for k in everything if ".visual." in f".{k}"}, "the tiny VL has a vision tower"
    if getattr(model.config, "tie_word_embeddings", False) and any(k.endswith("embed_tokens.weight") for k in keys):
        assert "lm_head.weight" in keys


def test_a_weight_frozen_after_it_was_pushed_as_changing_goes_whole_once(two_servers, lora_learner):
    """A parameter frozen mid-run may have changed since the servers last got it: every server gets every weight
    once more, then the smaller changing set."""
    (url_a, eng_a), _ = two_servers
    client = ServerRolloutEngine([ServerEndpoint(url_a)], timeout_s=30, transport="inband")
    try:
        embed = lora_learner.get_input_embeddings().weight
        embed.requires_grad_(True)
        client.sync_full(lora_learner)
        client.sync_full(lora_learner)
        with_embed = len(changing_keys(lora_learner))
        assert last_update(url_a)["num_tensors"] == with_embed
        with torch.no_grad():
            embed.add_(0.1)  # the last optimizer step that touches it, after the last sync
        embed.requires_grad_(False)
        client.sync_full(lora_learner)
        assert last_update(url_a)["num_tensors"] == len(full_weights(lora_learner))
        assert serves_learner(eng_a, lora_learner)
        client.sync_full(lora_learner)
        assert last_update(url_a)["num_tensors"] == len(changing_keys(lora_learner)) < with_embed
    finally:
        client.close()
