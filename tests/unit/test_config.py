"""Config: extends resolution, strict schema, and every rejected case names its key path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from trainer.config.errors import ConfigErrors
from trainer.config.loader import resolve_yaml
from trainer.config.schema import load_config, validate_config

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "model": {"tiny": "text"},
    "data": {"synthetic": {"num_samples": 4}},
    "custom": {"trainer_variant": "rollout_matching_sft",
               "extra": {"rollout_matching": {"rollout_backend": "hf"}}},
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


def errors_for(data) -> list[tuple[str, str]]:
    with pytest.raises(ConfigErrors) as exc:
        validate_config(data)
    return [(e.key_path, e.message) for e in exc.value.errors]


def merged(**patch):
    import copy

    from trainer.config.loader import deep_merge

    return deep_merge(copy.deepcopy(BASE), patch)


def test_extends_list_relative_deep_merge_and_list_replace(tmp_path):
    write(tmp_path, "bases/a.yaml", """
        training: {learning_rate: 0.1, report_to: [jsonl, tensorboard], seed: 1}
        model: {tiny: text}
    """)
    write(tmp_path, "bases/b.yaml", """
        extends: a.yaml
        training: {seed: 2}
    """)
    top = write(tmp_path, "top.yaml", """
        extends: [bases/b.yaml]
        training: {report_to: [jsonl]}
    """)
    data = resolve_yaml(top)
    assert data["training"] == {"learning_rate": 0.1, "report_to": ["jsonl"], "seed": 2}
    assert "extends" not in data


def test_extends_string_and_cycle_rejected(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\nx: 1\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\ny: 2\n")
    with pytest.raises(ConfigErrors) as exc:
        load_config(tmp_path / "a.yaml")
    assert exc.value.errors[0].key_path == "extends" and "cycle" in exc.value.errors[0].message


def test_missing_base_file_named(tmp_path):
    p = write(tmp_path, "a.yaml", "extends: nope.yaml\n")
    with pytest.raises(ConfigErrors, match="nope.yaml"):
        load_config(p)


@pytest.mark.parametrize(
    "patch, key, fragment",
    [
        ({"trainnig": {}}, "trainnig", "did you mean 'training'"),
        ({"custom": {"extra": {"rollout_matching": {"decodng": {}}}}}, "custom.extra.rollout_matching.decodng",
         "did you mean 'decoding'"),
        ({"training": {"packing_lenght": 10}}, "training.packing_lenght", "did you mean 'packing_length'"),
        ({"training": {"learning_rate": "fast"}}, "training.learning_rate", "number"),
        ({"training": {"per_device_train_batch_size": 0}}, "training.per_device_train_batch_size", "greater than"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_backend": "tgi"}}}},
         "custom.extra.rollout_matching.rollout_backend", "'vllm' or 'hf'"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_generate_batch_size": -1}}}},
         "custom.extra.rollout_matching.rollout_generate_batch_size", "greater than"),
        ({"custom": {"extra": {"rollout_matching": {"matching": {"mask_iou_threshold": 2}}}}},
         "custom.extra.rollout_matching.matching.mask_iou_threshold", "less than"),
        ({"model": {"path": "/x"}}, "model", "exactly one"),
        ({"data": {"train_jsonl": "x.jsonl"}}, "data", "exactly one"),
        ({"training": {"packing": True}}, "training.packing_length", "required"),
        ({"training": {"packing": True, "packing_length": 512, "packing_drop_last": False}},
         "training.packing_drop_last", "must be true"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm"}}}},
         "custom.extra.rollout_matching.vllm.max_model_len", "required"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_buffer": {"m_steps": 3}}}}},
         "custom.extra.rollout_matching.rollout_buffer.m_steps", "enable"),
        ({"custom": {"extra": {"rollout_matching": {"offload": {"enabled": True}}}}},
         "custom.extra.rollout_matching.offload.enabled", "colocate"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"max_model_len": 64}}}}},
         "custom.extra.rollout_matching.vllm.max_model_len", "max_new_tokens"),
        ({"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "server"}}}}},
         "custom.extra.rollout_matching.vllm.server.servers", "at least one server"),
        ({"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"host": ["127.0.0.1"], "port": [1, 2]}}}}}},
         "custom.extra.rollout_matching.vllm.server", "same length"),
        ({"tuner": {"train_type": "lora"}, "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "vllm": {"max_model_len": 4096, "enable_lora": False,
                                                "sync": {"mode": "adapter"}}}}}},
         "custom.extra.rollout_matching.vllm.enable_lora", "must be true with sync.mode: adapter"),
        ({"custom": {"extra": {"rollout_matching": {"loss": {"supervised_logits_only": False,
                                                             "logit_chunk_rows": 512}}}}},
         "custom.extra.rollout_matching.loss.logit_chunk_rows", "only applies with loss.supervised_logits_only"),
        ({"custom": {"extra": {"rollout_matching": {"loss": {"logit_chunk_rows": 0}}}}},
         "custom.extra.rollout_matching.loss.logit_chunk_rows", "greater than"),
    ],
)
def test_rejected_configs_name_their_key(patch, key, fragment):
    errs = errors_for(merged(**patch))
    assert any(k == key and fragment in msg for k, msg in errs), errs


def test_logit_chunks_are_on_by_default_and_off_with_full_logits_unless_asked_for():
    rm = validate_config(merged()).custom.extra.rollout_matching
    assert rm.loss.supervised_logits_only and rm.loss.logit_chunk_rows == 1024
    full = validate_config(merged(custom={"extra": {"rollout_matching": {"loss": {"supervised_logits_only": False}}}}))
    assert full.custom.extra.rollout_matching.loss.logit_chunk_rows == 1024  # inert: forward_loss chunks only supervised rows


def test_lora_engines_serve_the_adapter_unless_told_otherwise():
    """``vllm.enable_lora`` is left to the engine (null: on for a LoRA learner, ``colocate_enable_lora``) and a
    server sync picks the adapter where the servers serve it (``sync.mode: auto``); an explicit false stays false."""
    cfg = validate_config(merged(**{"tuner": {"train_type": "lora"}, "custom": {"extra": {"rollout_matching": {
        "rollout_backend": "vllm", "vllm": {"max_model_len": 4096}}}}}))
    v = cfg.custom.extra.rollout_matching.vllm
    assert v.enable_lora is None and v.sync.mode == "auto"
    off = validate_config(merged(**{"tuner": {"train_type": "lora"}, "custom": {"extra": {"rollout_matching": {
        "rollout_backend": "vllm", "vllm": {"max_model_len": 4096, "enable_lora": False}}}}}))
    assert off.custom.extra.rollout_matching.vllm.enable_lora is False


def test_missing_rollout_matching_section_named():
    data = {"model": {"tiny": "text"}, "data": {"synthetic": {}}}
    assert ("custom.extra.rollout_matching", "required when custom.trainer_variant is rollout_matching_sft") in errors_for(data)


def test_defaults_follow_the_seeds():
    cfg = validate_config({**BASE, "custom": {"extra": {"rollout_matching": {"vllm": {"max_model_len": 4096}}}}})
    rm = cfg.rollout_matching
    assert rm.rollout_backend == "vllm" and rm.rollout_generate_batch_size == 1
    assert rm.vllm.gpu_memory_utilization == 0.45 and rm.vllm.enable_prefix_caching is True
    assert cfg.training.packing is False and cfg.training.packing_drop_last is True


def test_every_shipped_config_validates():
    """``*_base.yaml`` files are fragments that other configs extend; every other config must validate."""
    paths = [p for p in sorted((REPO / "configs").glob("*.yaml")) if not p.stem.endswith("_base")]
    assert len(paths) >= 4
    for path in paths:
        load_config(path)


def test_validate_cli_prints_resolved_config_and_fails_with_key(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(BASE))
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", str(good)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["custom"]["extra"]["rollout_matching"]["decoding"]["max_new_tokens"] == 256
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(merged(training={"pakcing": True})))
    out = subprocess.run([sys.executable, "-m", "trainer", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "training.pakcing" in out.stderr and "did you mean 'packing'" in out.stderr


def test_missing_extras_fail_with_the_extra_named(monkeypatch):
    import sys

    from trainer.extras import MissingExtraError, require

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MissingExtraError, match=r"training.deepspeed.*'deepspeed'.*pip install -e '.\[deepspeed\]'"):
        require("deepspeed", "training.deepspeed (ds.json)")


def test_server_backend_without_a_healthy_server_fails_naming_it():
    from trainer.rollout.factory import build_rollout_engine
    from trainer.rollout.server_client import RolloutServerError

    cfg = validate_config(merged(custom={"extra": {"rollout_matching": {
        "rollout_backend": "vllm", "vllm": {"mode": "server", "server": {
            "servers": [{"base_url": "http://127.0.0.1:9"}], "timeout_s": 1}}}}}))
    with pytest.raises(RolloutServerError, match="127.0.0.1:9"):
        build_rollout_engine(cfg.rollout_matching, loaded=None, model=None)


def test_deepspeed_presets_and_files_validate_and_resolve(tmp_path):
    from transformers import TrainingArguments

    from trainer.sft.deepspeed_config import PRESETS, resolve

    [(key, message)] = errors_for(merged(training={"deepspeed": "zero5"}))
    assert key == "training.deepspeed" and "zero2_offload" in message and "JSON file" in message
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"stage": 2}}')
    for value in (*PRESETS, str(ds_json)):
        assert validate_config(merged(training={"deepspeed": value})).training.deepspeed == value
    assert resolve(str(ds_json)) == str(ds_json)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=resolve("zero3_offload"), use_cpu=True,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, report_to=[])
    ds = args.hf_deepspeed_config.config
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
