"""The ``vllm.sync`` settings reach the rollout engines built from a config (colocate and server mode). The engine
classes are replaced by recorders: what is checked is the hand-over from the validated config, not vLLM."""

from __future__ import annotations

import pytest
import torch

from trainer.config.schema import validate_config
from trainer.modeling.loading import LoadedModel

RM = "custom.extra.rollout_matching"


class Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def rm_config(vllm: dict) -> object:
    cfg = validate_config({"model": {"tiny": "text"}, "data": {"train_jsonl": "train.jsonl"},
                           "custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": vllm}}}})
    return cfg.custom.extra.rollout_matching


@pytest.fixture
def loaded(tiny_text_dir, tiny_tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
    return LoadedModel(model, tiny_tok, None, tiny_text_dir, "qwen3")


@pytest.mark.parametrize("precision", ["weight_dtype", "float32"])
def test_colocate_engine_gets_the_merge_precision(monkeypatch, loaded, precision):
    from trainer.rollout import vllm_colocate

    monkeypatch.setattr(vllm_colocate, "VllmColocateEngine", Recorder)
    rm = rm_config({"max_model_len": 1024, "sync": {"merge_precision": precision}})
    engine = vllm_colocate.engine_from_config(rm, loaded, loaded.model)
    assert engine.kwargs["merge_precision"] == precision


def test_colocate_default_merge_precision_is_the_weight_dtype(monkeypatch, loaded):
    from trainer.rollout import vllm_colocate

    monkeypatch.setattr(vllm_colocate, "VllmColocateEngine", Recorder)
    engine = vllm_colocate.engine_from_config(rm_config({"max_model_len": 1024}), loaded, loaded.model)
    assert engine.kwargs["merge_precision"] == "weight_dtype"


def test_server_engine_gets_the_sync_settings(monkeypatch, loaded):
    from trainer.rollout import server_client

    monkeypatch.setattr(server_client, "ServerRolloutEngine", Recorder)
    monkeypatch.setattr(Recorder, "metadata", lambda self: {"servers": [], "servers_this_rank": []}, raising=False)
    rm = rm_config({"mode": "server", "server": {"servers": [{"base_url": "http://127.0.0.1:1"}]},
                    "sync": {"transport": "inband", "merge_precision": "float32", "resend_frozen": True}})
    engine = server_client.engine_from_config(rm, loaded, loaded.model)
    assert engine.kwargs["merge_precision"] == "float32" and engine.kwargs["resend_frozen"] is True


def test_an_unknown_merge_precision_is_a_config_error_naming_the_key():
    from trainer.config.errors import ConfigErrors

    with pytest.raises(ConfigErrors) as info:
        rm_config({"max_model_len": 1024, "sync": {"merge_precision": "fp8"}})
    assert f"{RM}.vllm.sync.merge_precision" in str(info.value)
