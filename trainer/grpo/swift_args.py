"""Our config → ms-swift arguments: ``swift rlhf`` (``RLHFArguments``) for the learner and ``swift rollout``
(``RolloutArguments``) for the server. Pure functions of the validated config (``trainer.config.schema.TrainConfig``,
read by attribute); ``tests/grpo`` proves the mapping by constructing ms-swift's own argument classes from these
values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigError
from trainer.config.grpo import IGNORED_IN_SERVER_MODE, GrpoSections, grpo_sections, server_endpoint
from trainer.config.schema import TrainConfig

PLUGIN_FILE = Path(__file__).with_name("swift_plugin.py")

_TRAINING_KEYS = (
    "output_dir", "learning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "weight_decay", "warmup_ratio", "lr_scheduler_type", "max_grad_norm", "seed", "logging_steps",
    "save_total_limit", "gradient_checkpointing", "dataloader_num_workers", "deepspeed",
)
_RLHF_OWN_KEYS = frozenset({"model_type", "template"})
_SERVER_CONNECTION_KEYS = frozenset({"vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                                     "vllm_server_group_port"})


def model_path(cfg: TrainConfig) -> str:
    path = cfg.model.path
    if not path:
        raise ConfigError("model.path", "summary GRPO runs through ms-swift, which loads a local model directory; "
                                        "set model.path (model.tiny is for the stage-2 trainer only)")
    return str(path)


def _tuner_arguments(cfg: TrainConfig) -> dict[str, Any]:
    t = cfg.tuner
    out: dict[str, Any] = {"tuner_type": "full" if t.train_type == "full" else "lora"}
    if t.train_type in ("lora", "dora"):
        targets = t.target_modules
        out.update(use_dora=t.train_type == "dora", lora_rank=t.lora_rank, lora_alpha=t.lora_alpha,
                   lora_dropout=t.lora_dropout, target_modules=[targets] if isinstance(targets, str) else list(targets))
    out["freeze_vit"] = t.freeze_vit
    out["freeze_aligner"] = t.freeze_aligner
    return out


def _training_arguments(cfg: TrainConfig) -> dict[str, Any]:
    t = cfg.training
    out = {k: getattr(t, k) for k in _TRAINING_KEYS}
    if t.max_steps > 0:
        out["max_steps"] = t.max_steps
    if t.save_steps:
        out["save_steps"] = t.save_steps
    else:
        out["save_strategy"] = "no"
    out["bf16"] = t.bf16
    # tensorboard, wandb and mlflow are HF's report_to names too: ms-swift's trainer logs through HF's callbacks
    # (its own logging.jsonl, no metrics.jsonl of ours to mirror)
    report = [r for r in t.report_to if r != "jsonl"]
    out["report_to"] = report or ["none"]
    out["eval_strategy"] = "no"
    out["check_model"] = False  # ms-swift would ask the ModelScope hub whether a local model is outdated
    return out


def rlhf_arguments(cfg: TrainConfig) -> dict[str, Any]:
    """``RLHFArguments`` keyword arguments for the learner (``None`` values left out = ms-swift defaults)."""
    s = grpo_sections(cfg)
    out: dict[str, Any] = {"model": model_path(cfg)}
    out.update(_model_arguments(cfg, s))
    out.update(_tuner_arguments(cfg))
    out.update(_training_arguments(cfg))
    train_jsonl = cfg.data.train_jsonl
    if not train_jsonl:
        raise ConfigError("data.train_jsonl", "summary GRPO reads a JSONL dataset (messages, images, summary_ref, "
                                              "metadata); write one with python -m trainer.grpo.summary_data")
    out["dataset"] = [str(train_jsonl)]
    out["system"] = cfg.data.system_prompt
    server_mode = s.rlhf.vllm_mode == "server"
    for key, value in s.rlhf.model_dump().items():
        if key in _RLHF_OWN_KEYS or (server_mode and key in IGNORED_IN_SERVER_MODE):
            continue
        if not server_mode and key in _SERVER_CONNECTION_KEYS:
            continue  # ms-swift connects to any vllm_server_host it is given, whatever vllm_mode says
        out[key] = value
    if any(f.startswith("summary.") for f in s.rlhf.reward_funcs):
        out["external_plugins"] = [str(PLUGIN_FILE)]
    return {k: v for k, v in out.items() if v is not None}


def _model_arguments(cfg: TrainConfig, s: GrpoSections) -> dict[str, Any]:
    return {"model_type": s.rlhf.model_type, "template": s.rlhf.template,
            "torch_dtype": cfg.model.torch_dtype, "attn_impl": cfg.model.attn_implementation}


def rollout_arguments(cfg: TrainConfig, model: str | None = None, host: str | None = None,
                      port: int | None = None) -> dict[str, Any]:
    """``RolloutArguments`` keyword arguments for ``swift rollout`` from ``custom.extra.rollout_server``."""
    s = grpo_sections(cfg)
    rs = s.rollout_server
    if rs is None:
        raise ConfigError("custom.extra.rollout_server", "required to launch swift rollout from this config")
    cfg_host, cfg_port = server_endpoint(s)
    out: dict[str, Any] = {"model": model or model_path(cfg)}
    out.update(_model_arguments(cfg, s))
    out.pop("attn_impl")
    out.update(host=host or cfg_host, port=port or cfg_port,
               vllm_tensor_parallel_size=rs.vllm_tensor_parallel_size,
               vllm_data_parallel_size=rs.vllm_data_parallel_size,
               vllm_max_model_len=rs.vllm_max_model_len,
               vllm_gpu_memory_utilization=rs.vllm_gpu_memory_utilization,
               vllm_enable_lora=rs.vllm_enable_lora,
               vllm_max_num_seqs=rs.vllm_max_num_seqs,
               vllm_enable_prefix_caching=rs.vllm_enable_prefix_caching,
               vllm_limit_mm_per_prompt=rs.vllm_limit_mm_per_prompt,
               vllm_enforce_eager=rs.vllm_enforce_eager,
               vllm_use_async_engine=rs.vllm_use_async_engine)
    return {k: v for k, v in out.items() if v is not None}


def _token(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def to_argv(arguments: dict[str, Any]) -> list[str]:
    """ms-swift's command-line form: ``--key value``; lists as consecutive values, dicts as JSON."""
    argv: list[str] = []
    for key, value in arguments.items():
        argv.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            argv.extend(_token(v) for v in value)
        else:
            argv.append(_token(value))
    return argv
