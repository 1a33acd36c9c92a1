"""Config → ms-swift arguments. Pure mapping checks, then proof against ms-swift itself: its parser and
argument classes (``RolloutArguments`` for ``swift rollout``, ``RLHFArguments`` → ``GRPOConfig`` for
``swift rlhf``) accept our command lines for both summary configs, with a real local (tiny Qwen3-VL) model,
and our reward plugin scores through ms-swift's own reward path (see ``swift_probe.py`` for what is simulated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.grpo.conftest import REPO, SUMMARY_CONFIGS
from trainer.config.errors import ConfigError
from trainer.config.loader import deep_merge, resolve_yaml
from trainer.config.schema import validate_config
from trainer.grpo.rewards import reference_from_row, score
from trainer.grpo.schema_tree import SCHEMA_DATASET_ENV
from trainer.grpo.swift_args import PLUGIN_FILE, rlhf_arguments, rollout_arguments, to_argv


def test_dora_maps_to_lora_with_use_dora(summary_cfg):
    a = rlhf_arguments(validate_config(summary_cfg))
    assert (a["tuner_type"], a["use_dora"], a["lora_rank"], a["lora_alpha"]) == ("lora", True, 32, 64)
    assert a["target_modules"] == ["all-linear"] and a["freeze_vit"] is False and a["freeze_aligner"] is False
    summary_cfg["tuner"]["train_type"] = "full"
    a = rlhf_arguments(validate_config(summary_cfg))
    assert a["tuner_type"] == "full" and "use_dora" not in a and "lora_rank" not in a


def test_server_mode_drops_fields_ms_swift_ignores(summary_cfg):
    summary_cfg["rlhf"].update(vllm_max_model_len=4096, vllm_gpu_memory_utilization=0.9)
    a = rlhf_arguments(validate_config(summary_cfg))
    assert "vllm_max_model_len" not in a and "vllm_gpu_memory_utilization" not in a
    summary_cfg["rlhf"]["vllm_mode"] = "colocate"
    a = rlhf_arguments(validate_config(summary_cfg))
    assert a["vllm_max_model_len"] == 4096 and a["vllm_gpu_memory_utilization"] == 0.9
    assert not any(k.startswith("vllm_server_") for k in a)  # ms-swift would connect to any host given


def test_learner_arguments_carry_connectivity_and_plugin(summary_cfg):
    a = rlhf_arguments(validate_config(summary_cfg))
    assert a["vllm_server_host"] == ["127.0.0.1"] and a["vllm_server_port"] == [8080]
    assert a["external_plugins"] == [str(PLUGIN_FILE)] and PLUGIN_FILE.is_file()
    assert a["dataset"] == ["/data/summary/train.jsonl"] and a["save_steps"] == 100
    assert a["report_to"] == ["tensorboard"] and a["eval_strategy"] == "no"
    assert a["check_model"] is False  # no hub call about a local model
    summary_cfg["rlhf"]["reward_funcs"] = ["accuracy"]
    summary_cfg["rlhf"]["reward_weights"] = None
    assert "external_plugins" not in rlhf_arguments(validate_config(summary_cfg))


def test_wandb_and_mlflow_reach_ms_swift_as_hf_report_to_names(summary_cfg):
    """ms-swift's trainer is HF's: its own callbacks log there; jsonl (ours, stage-2 SFT only) is left out."""
    summary_cfg["training"]["report_to"] = ["jsonl", "wandb", "mlflow"]
    assert rlhf_arguments(validate_config(summary_cfg))["report_to"] == ["wandb", "mlflow"]
    summary_cfg["training"]["report_to"] = ["jsonl"]
    assert rlhf_arguments(validate_config(summary_cfg))["report_to"] == ["none"]


def test_model_path_and_dataset_required(summary_cfg):
    summary_cfg["model"] = {"tiny": "vl"}
    with pytest.raises(ConfigError, match="model.path"):
        rlhf_arguments(validate_config(summary_cfg))
    summary_cfg["model"] = {"path": "/m"}
    del summary_cfg["data"]["train_jsonl"]
    summary_cfg["data"]["synthetic"] = {"num_samples": 4}  # valid for the schema, but not a GRPO dataset
    with pytest.raises(ConfigError) as exc:
        rlhf_arguments(validate_config(summary_cfg))
    assert exc.value.key_path == "data.train_jsonl"


def test_rollout_arguments_from_rollout_server(summary_cfg):
    a = rollout_arguments(validate_config(summary_cfg))
    assert a == {"model": "/models/Qwen3-VL-4B", "model_type": "qwen3_vl", "torch_dtype": "bfloat16",
                 "host": "127.0.0.1", "port": 8080, "vllm_tensor_parallel_size": 1, "vllm_data_parallel_size": 6,
                 "vllm_max_model_len": 8192, "vllm_gpu_memory_utilization": 0.6, "vllm_enable_lora": False,
                 "vllm_limit_mm_per_prompt": {"image": 1}}
    assert rollout_arguments(validate_config(summary_cfg), model="/other", port=9000)["port"] == 9000
    del summary_cfg["custom"]["extra"]["rollout_server"]
    summary_cfg["rlhf"]["vllm_mode"] = "colocate"  # the schema requires the section in server mode
    with pytest.raises(ConfigError, match="custom.extra.rollout_server"):
        rollout_arguments(validate_config(summary_cfg))


def test_to_argv_formats_like_ms_swift_cli():
    argv = to_argv({"a": True, "b": [1, "x"], "c": {"image": 1}, "d": 0.5})
    assert argv == ["--a", "true", "--b", "1", "x", "--c", '{"image": 1}', "--d", "0.5"]


# --- against ms-swift itself -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def probe(tmp_path_factory, summary_dataset):
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    from trainer.modeling.fixtures import save_tiny_model

    root = tmp_path_factory.mktemp("swift_probe")
    model = save_tiny_model(root / "tiny_vl", kind="vl")
    spec = {}
    for path in SUMMARY_CONFIGS:
        cfg = deep_merge(resolve_yaml(REPO / path), {"model": {"path": str(model)},
                                                      "data": {"train_jsonl": str(summary_dataset)},
                                                      "training": {"output_dir": str(root / "out")}})
        spec[path] = {"kind": "rlhf", "argv": to_argv(rlhf_arguments(validate_config(cfg))), "dataset": str(summary_dataset)}
        spec[path + ":rollout"] = {"kind": "rollout", "argv": to_argv(rollout_arguments(validate_config(cfg))), "device_count": 6}
    spec["too_few_gpus"] = dict(spec[SUMMARY_CONFIGS[0] + ":rollout"], device_count=4)
    env = dict(os.environ, VLLM_PLUGINS="", TOKENIZERS_PARALLELISM="false",
               **{SCHEMA_DATASET_ENV: str(summary_dataset)})
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        env.pop(k, None)
    # 1800 s bounds a hang only: ~210 s here on a loaded 2-core machine, most of it waiting for DeepSpeed's CPU ops
    # to build (tests/deepspeed_ops.py) on a fresh machine
    proc = subprocess.run([sys.executable, "-m", "tests.grpo.swift_probe", json.dumps(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"result": json.loads(lines[-1].removeprefix("PROBE-RESULT ")), "model": str(model),
            "dataset": str(summary_dataset)}


@pytest.mark.parametrize("path", SUMMARY_CONFIGS)
def test_rollout_arguments_accepted_by_swift_rollout(probe, path):
    r = probe["result"][path + ":rollout"]
    assert r["rest"] == []
    assert (r["model"], r["model_type"], r["host"], r["port"]) == (probe["model"], "qwen3_vl", "127.0.0.1", 8080)
    assert (r["vllm_tensor_parallel_size"], r["vllm_data_parallel_size"]) == (1, 6)
    assert (r["vllm_max_model_len"], r["vllm_gpu_memory_utilization"], r["vllm_enable_lora"]) == (8192, 0.6, False)
    assert r["vllm_limit_mm_per_prompt"] == {"image": 1} and r["torch_dtype"] == "torch.bfloat16"


def test_swift_rollout_refuses_fewer_devices_than_tp_times_dp(probe):
    assert "must be greater than or equal to the product" in probe["result"]["too_few_gpus"]["error"]


@pytest.mark.parametrize("path", SUMMARY_CONFIGS)
def test_rlhf_arguments_accepted_by_swift_rlhf(probe, path):
    r = probe["result"][path]
    cfg = resolve_yaml(REPO / path)
    assert r["rest"] == [] and r["training_args_class"] == "GRPOConfig"
    assert r["handshakes"] == [{"hosts": ["127.0.0.1"], "ports": [8080], "timeout": 600.0}]
    a = r["args"]
    assert (a["rlhf_type"], a["tuner_type"], a["use_dora"], a["lora_rank"], a["lora_alpha"]) == ("grpo", "lora", True, 32, 64)
    assert a["freeze_vit"] is False and a["freeze_aligner"] is False and a["max_length"] == 8192
    assert a["reward_funcs"] == cfg["rlhf"]["reward_funcs"] and a["reward_weights"] == cfg["rlhf"]["reward_weights"]
    assert a["dataset"] == [probe["dataset"]] and a["external_plugins"][0].endswith("swift_plugin.py")
    t = r["training"]
    assert (t["use_vllm"], t["vllm_mode"], t["vllm_server_host"], t["vllm_server_port"]) == (True, "server", ["127.0.0.1"], [8080])
    assert (t["num_generations"], t["temperature"], t["repetition_penalty"], t["max_completion_length"]) == (4, 0.7, 1.05, 2048)
    assert (t["beta"], t["advantage_estimator"], t["scale_rewards"], t["kl_in_reward"], t["dynamic_sample"]) == \
        (0.04, "reinforce_plus_plus", "batch", True, True)
    # one process here: 24 trajectories per generation / (4 per device × 1 rank) = 6 steps per generation
    assert (t["generation_batch_size"], t["steps_per_generation"]) == (24, 6)
    assert (t["learning_rate"], t["per_device_train_batch_size"], t["gradient_accumulation_steps"], t["bf16"]) == (1e-5, 4, 3, True)
    assert r["zero_stage"] == 3
    assert set(cfg["rlhf"]["reward_funcs"]) <= set(r["registered"])


@pytest.mark.parametrize("path", SUMMARY_CONFIGS)
def test_plugin_scores_through_ms_swift_reward_path(probe, path):
    from trainer.grpo.rewards import RewardContext
    from trainer.grpo.schema_tree import schema_tree_from_jsonl

    r = probe["result"][path]
    funcs = r["args"]["reward_funcs"]
    ctx = RewardContext(schema_tree=schema_tree_from_jsonl([probe["dataset"]]))
    assert len(r["rewards"]) == len(r["reward_rows"]) > 0
    for row, got in zip(r["reward_rows"], r["rewards"]):
        ref = reference_from_row(row["summary_ref"], {"domain": row["domain"]})
        want = [score(name, row["completion"], ref, ctx) for name in funcs]
        assert got == pytest.approx(want), (row, funcs)
    fmt = funcs.index("summary.format")
    assert {round(x[fmt]) for x in r["rewards"][0::2]} == {1} and {round(x[fmt]) for x in r["rewards"][1::2]} == {0}


def test_async_generate_reaches_ms_swift_in_server_mode_only(summary_cfg):
    """Summary GRPO's overlap is ms-swift's own ``async_generate``: passed through, server mode only."""
    summary_cfg["rlhf"]["async_generate"] = True
    assert rlhf_arguments(validate_config(summary_cfg))["async_generate"] is True
    summary_cfg["rlhf"]["vllm_mode"] = "colocate"
    with pytest.raises(Exception, match="rlhf.async_generate"):
        validate_config(summary_cfg)


def test_swift_s_qwen3_vl_loader_finds_the_qwen_vl_utils_our_swift_extra_installs():
    """ms-swift loads a Qwen2/3-VL processor (``swift rollout`` / ``swift rlhf`` on Qwen3-VL) only after its loader's
    version check on ``qwen_vl_utils`` passes; the ``swift`` extra installs it (the processor itself then imports
    torchvision, which only the GPU environment has)."""
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via the swift extra)")
    from swift.model.models.qwen import Qwen2VLLoader, Qwen3VLLoader

    for loader in (Qwen3VLLoader, Qwen2VLLoader):
        loader._check_qwen_vl_utils(None)  # raises PackageNotFoundError / ImportError without it
