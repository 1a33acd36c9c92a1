"""The command lines the launchers exec, built from the shipped configs and from flags."""

from __future__ import annotations

import copy
import shlex
import sys

import pytest

from tests.launch.conftest import REPO
from trainer.config.errors import ConfigError
from trainer.config.loader import deep_merge, resolve_yaml
from trainer.config.schema import validate_config
from trainer.launch.commands import (
    ServerOptions,
    config_server_urls,
    learner_command,
    server_command,
    server_endpoint_for,
)
from trainer.launch.gpus import parse_gpus

SUMMARY = REPO / "configs/summary_1024.yaml"
ATTR = REPO / "configs/summary_1024_attr_key_recall.yaml"
STAGE2 = REPO / "configs/rollout_matching_sft_template.yaml"


@pytest.fixture
def summary():
    return validate_config(copy.deepcopy(resolve_yaml(SUMMARY)))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_swift_rollout_command_from_config(summary):
    cmd = server_command(ServerOptions(engine="swift"), summary)
    assert cmd.argv[:2] == ["swift", "rollout"]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
    a = cmd.argv
    assert (_flag(a, "--host"), _flag(a, "--port"), _flag(a, "--model")) == ("127.0.0.1", "8080", "/models/Qwen3-VL-4B")
    assert (_flag(a, "--vllm_tensor_parallel_size"), _flag(a, "--vllm_data_parallel_size")) == ("1", "6")
    assert (_flag(a, "--vllm_max_model_len"), _flag(a, "--vllm_gpu_memory_utilization")) == ("8192", "0.6")
    assert _flag(a, "--vllm_enable_lora") == "false" and _flag(a, "--model_type") == "qwen3_vl"
    assert shlex.split(cmd.shell()) == ["CUDA_VISIBLE_DEVICES=0,1,2,3,4,5", *a]
    assert server_endpoint_for(ServerOptions(engine="swift"), summary) == ("127.0.0.1", 8080)


def test_flags_override_config(summary):
    opts = ServerOptions(engine="swift", port=8090, gpus=[2, 3], model="/m", data_parallel_size=2,
                         gpu_memory_utilization=0.8, extra=["--vllm_enforce_eager", "true"])
    a = server_command(opts, summary).argv
    assert (_flag(a, "--port"), _flag(a, "--model"), _flag(a, "--vllm_data_parallel_size")) == ("8090", "/m", "2")
    assert _flag(a, "--vllm_gpu_memory_utilization") == "0.8" and a[-2:] == ["--vllm_enforce_eager", "true"]


def test_swift_gpu_count_must_match_tp_dp(summary):
    with pytest.raises(ConfigError, match="give exactly 6") as exc:
        server_command(ServerOptions(engine="swift", gpus=[0, 1]), summary)
    assert exc.value.key_path == "--gpus"


def test_swift_lora_refused_for_summary_config(summary):
    with pytest.raises(ConfigError, match="forbids vLLM LoRA"):
        server_command(ServerOptions(engine="swift", enable_lora=True), summary)


def test_swift_without_config_needs_model():
    with pytest.raises(ConfigError, match="--model"):
        server_command(ServerOptions(engine="swift"))
    cmd = server_command(ServerOptions(engine="swift", model="/m", gpus=[0, 1], tensor_parallel_size=2,
                                       max_model_len=4096, model_type="qwen3_vl"))
    assert cmd.argv == ["swift", "rollout", "--model", "/m", "--host", "127.0.0.1", "--port", "8000",
                        "--vllm_tensor_parallel_size", "2", "--vllm_max_model_len", "4096", "--model_type", "qwen3_vl"]


def test_trainer_serve_commands():
    cmd = server_command(ServerOptions(engine="vllm", port=8001, gpus=[3], model="/m", max_model_len=4096,
                                       gpu_memory_utilization=0.5, enable_lora=False))
    assert cmd.argv == [sys.executable, "-m", "trainer", "serve", "--engine", "vllm", "--host", "127.0.0.1",
                        "--port", "8001", "--model", "/m", "--gpu-memory-utilization", "0.5",
                        "--max-model-len", "4096", "--no-enable-lora"]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "3"}
    scripted = server_command(ServerOptions(engine="scripted"))
    assert scripted.argv[-6:] == ["--engine", "scripted", "--host", "127.0.0.1", "--port", "8000"] and scripted.env == {}
    with pytest.raises(ConfigError, match="no data parallelism"):
        server_command(ServerOptions(engine="hf", data_parallel_size=2))


def test_our_engine_takes_endpoint_from_grpo_config(summary):
    a = server_command(ServerOptions(engine="scripted"), summary).argv
    assert (_flag(a, "--host"), _flag(a, "--port")) == ("127.0.0.1", "8080") and "--model" not in a
    assert _flag(server_command(ServerOptions(engine="hf"), summary).argv, "--model") == "/models/Qwen3-VL-4B"


@pytest.mark.parametrize("path", [SUMMARY, ATTR])
def test_grpo_learner_is_swift_rlhf(path):
    cfg = validate_config(resolve_yaml(path))
    cmd = learner_command(str(path), cfg, nproc=2, gpus=[6, 7])
    assert cmd.argv[:2] == ["swift", "rlhf"]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "6,7", "NPROC_PER_NODE": "2",
                       "SUMMARY_SCHEMA_DATASET": "/data/summary/train.jsonl"}
    a = cmd.argv
    assert (_flag(a, "--vllm_mode"), _flag(a, "--vllm_server_host"), _flag(a, "--vllm_server_port")) == \
        ("server", "127.0.0.1", "8080")
    funcs = a[a.index("--reward_funcs") + 1:a.index("--reward_weights")]
    assert funcs == cfg.rlhf.reward_funcs
    assert "--vllm_max_model_len" not in a and "--vllm_gpu_memory_utilization" not in a


def test_grpo_learner_checks_generation_batch_against_ranks(summary):
    with pytest.raises(ConfigError, match="4 × 4 = 16"):
        learner_command(str(SUMMARY), summary, nproc=4, gpus=None)


def test_stage2_learner_is_torchrun():
    cfg = validate_config(resolve_yaml(STAGE2))
    cmd = learner_command(str(STAGE2), cfg, nproc=2, gpus=[0, 1], extra=["--max-steps", "3"])
    assert cmd.argv == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "trainer",
                        "train", "--config", str(STAGE2), "--max-steps", "3"]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_learner_rendezvous_port_reaches_torchrun_and_swift(summary):
    stage2 = learner_command(str(STAGE2), validate_config(resolve_yaml(STAGE2)), nproc=2, gpus=None, master_port=23456)
    assert stage2.argv[3:7] == ["--nproc_per_node", "2", "--master-port", "23456"] and stage2.env == {}
    grpo = learner_command(str(SUMMARY), summary, nproc=2, gpus=[6, 7], master_port=23457)
    assert grpo.env["MASTER_PORT"] == "23457" and "--master-port" not in grpo.argv  # swift rlhf hands it to torchrun
    assert "MASTER_PORT" not in learner_command(str(SUMMARY), summary, nproc=2, gpus=[6, 7]).env


def test_config_server_urls(summary):
    assert config_server_urls(summary) == ["http://127.0.0.1:8080"]
    template = resolve_yaml(STAGE2)

    def server_mode(server: dict):
        return validate_config(deep_merge(template, {"custom": {"extra": {"rollout_matching": {"vllm": {
            "mode": "server", "server": server}}}}}))

    stage2 = server_mode({"servers": [{"base_url": "http://127.0.0.1:8001/"}, {"base_url": "http://127.0.0.1:8002"}]})
    assert config_server_urls(stage2) == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert config_server_urls(server_mode({"host": ["127.0.0.1"], "port": [9000]})) == ["http://127.0.0.1:9000"]
    assert config_server_urls(validate_config(template)) == []


@pytest.mark.parametrize("text,err", [("", "comma-separated"), ("0,,1", "comma-separated"), ("a", "'a' is not"),
                                      ("-1", "'-1' is not"), ("1,1", "GPU 1 listed twice")])
def test_parse_gpus_errors(text, err):
    with pytest.raises(ValueError, match=err):
        parse_gpus(text)


def test_parse_gpus():
    assert parse_gpus("6, 7") == [6, 7]
