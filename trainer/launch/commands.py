"""Pure builders for the commands the launchers exec: ``swift rollout``, ``python -m trainer serve``,
``swift rlhf`` (summary GRPO) and ``torchrun … -m trainer train`` (stage 2). ``config`` is always the validated
``TrainConfig`` (``trainer.config.schema.validate_config``), read by attribute."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from trainer.config.errors import ConfigError
from trainer.config.grpo import GRPO_VARIANT, grpo_sections, server_endpoint, server_urls
from trainer.config.schema import TrainConfig
from trainer.grpo.schema_tree import SCHEMA_DATASET_ENV
from trainer.grpo.swift_args import rlhf_arguments, rollout_arguments, to_argv
from trainer.launch.gpus import visible_devices


@dataclass(frozen=True)
class LaunchCommand:
    """What to exec: ``argv`` with ``env`` added to the current environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """One copy-pasteable shell line (env assignments first)."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class ServerOptions:
    """``launch server`` flags; ``None`` means "from the config, else the engine's default"."""

    engine: str
    host: str | None = None
    port: int | None = None
    gpus: list[int] | None = None
    model: str | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    enable_lora: bool | None = None
    model_type: str | None = None
    template: str | None = None
    extra: list[str] = field(default_factory=list)


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _gpu_env(gpus: list[int] | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": visible_devices(gpus)} if gpus is not None else {}


def server_endpoint_for(opts: ServerOptions, config: TrainConfig | None = None) -> tuple[str, int]:
    """Where the server will listen: flags, else the GRPO config's rollout server, else 127.0.0.1:8000."""
    host, port = DEFAULT_HOST, DEFAULT_PORT
    if config is not None and config.rlhf is not None:
        host, port = server_endpoint(grpo_sections(config))
    return opts.host or host, opts.port or port


def swift_rollout_command(opts: ServerOptions, config: TrainConfig | None = None) -> LaunchCommand:
    """``swift rollout`` from ``custom.extra.rollout_server`` (when ``config`` is given) with flags overriding it."""
    if config is not None:
        args = rollout_arguments(config, model=opts.model, host=opts.host, port=opts.port)
        rs = config.custom.extra.rollout_server
        gpus = opts.gpus if opts.gpus is not None else (rs.gpus if rs is not None else None)
    else:
        if not opts.model:
            raise ConfigError("--model", "swift rollout needs --model DIR (or --config with model.path)")
        args = {"model": opts.model, "host": opts.host or DEFAULT_HOST, "port": opts.port or DEFAULT_PORT}
        gpus = opts.gpus
    overrides = {"vllm_tensor_parallel_size": opts.tensor_parallel_size,
                 "vllm_data_parallel_size": opts.data_parallel_size,
                 "vllm_gpu_memory_utilization": opts.gpu_memory_utilization,
                 "vllm_max_model_len": opts.max_model_len,
                 "vllm_enable_lora": opts.enable_lora,
                 "model_type": opts.model_type,
                 "template": opts.template}
    args.update({k: v for k, v in overrides.items() if v is not None})
    if config is not None and args.get("vllm_enable_lora"):
        raise ConfigError("--enable-lora", "this config forbids vLLM LoRA (custom.extra.rollout_server.vllm_enable_lora "
                                           "must be false: multimodal DoRA syncs full weights)")
    world = int(args.get("vllm_tensor_parallel_size", 1)) * int(args.get("vllm_data_parallel_size", 1))
    if gpus is not None and len(gpus) != world:
        raise ConfigError("--gpus", f"{len(gpus)} GPU(s) {list(gpus)} for tensor_parallel_size × data_parallel_size "
                                    f"= {world}; give exactly {world}")
    return LaunchCommand(["swift", "rollout", *to_argv(args), *opts.extra], _gpu_env(gpus))


def trainer_serve_command(opts: ServerOptions, config: TrainConfig | None = None) -> LaunchCommand:
    """``python -m trainer serve`` (our rollout server) with the engine flags it understands; a config supplies
    the endpoint (GRPO rollout server), ``model.path`` for engines that load a model and, for the scripted stub,
    the world size of the ``swift rollout`` server it stands in for (``custom.extra.rollout_server``: TP × DP)."""
    if opts.data_parallel_size not in (None, 1) and opts.engine != "scripted":
        raise ConfigError("--data-parallel-size", f"trainer serve has no data parallelism (got "
                                                  f"{opts.data_parallel_size}); run one server per GPU group, or "
                                                  "use --engine swift")
    host, port = server_endpoint_for(opts, config)
    model = opts.model or (config.model.path if config is not None and opts.engine != "scripted" else None)
    argv = [sys.executable, "-m", "trainer", "serve", "--engine", opts.engine, "--host", host, "--port", str(port)]
    if model:
        argv += ["--model", str(model)]
    if opts.engine == "vllm":
        if opts.tensor_parallel_size is not None:
            argv += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
        if opts.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
        if opts.max_model_len is not None:
            argv += ["--max-model-len", str(opts.max_model_len)]
        if opts.enable_lora is not None:
            argv += ["--enable-lora" if opts.enable_lora else "--no-enable-lora"]
    if opts.engine == "scripted":  # the stub reports the world size of the server it stands in for: the flags, else
        rs = config.custom.extra.rollout_server if config is not None else None  # the GRPO config's swift rollout
        tp = opts.tensor_parallel_size or (rs.vllm_tensor_parallel_size if rs is not None else None)
        dp = opts.data_parallel_size or (rs.vllm_data_parallel_size if rs is not None else None)
        if tp is not None:
            argv += ["--tensor-parallel-size", str(tp)]
        if dp is not None:
            argv += ["--data-parallel-size", str(dp)]
    return LaunchCommand(argv + list(opts.extra), _gpu_env(opts.gpus))


def server_command(opts: ServerOptions, config: TrainConfig | None = None) -> LaunchCommand:
    if opts.engine == "swift":
        return swift_rollout_command(opts, config)
    return trainer_serve_command(opts, config)


def trainer_variant(config: TrainConfig) -> str:
    return config.custom.trainer_variant


def config_server_urls(config: TrainConfig) -> list[str]:
    """The rollout servers a config's learner talks to (GRPO: ``rlhf.vllm_server_*``; stage 2: ``vllm.server``)."""
    if trainer_variant(config) == GRPO_VARIANT:
        return server_urls(grpo_sections(config)) if config.rlhf is not None and config.rlhf.vllm_mode == "server" else []
    rm = config.custom.extra.rollout_matching
    if rm is None or rm.vllm.mode != "server":
        return []
    return rm.vllm.server.base_urls()


def learner_command(config_path: str, config: TrainConfig, nproc: int, gpus: list[int] | None,
                    extra: list[str] | None = None, master_port: int | None = None,
                    resume_from: str | None = None) -> LaunchCommand:
    """``swift rlhf`` for ``grpo_summary`` configs, else ``torchrun -m trainer train`` (stage 2). ``master_port``:
    the processes' rendezvous port (``MASTER_PORT`` for ``swift rlhf``, which hands it to its torchrun;
    ``--master-port`` for torchrun); ``None`` leaves torchrun's default, 29500. ``resume_from``: a stage-2
    checkpoint folder the training resumes from (``--resume-from-checkpoint``)."""
    extra = list(extra or [])
    env = _gpu_env(gpus)
    if trainer_variant(config) == GRPO_VARIANT:
        s = grpo_sections(config)
        global_batch = s.per_device_train_batch_size * nproc
        gbs = s.rlhf.generation_batch_size
        if gbs is not None and gbs % global_batch:
            raise ConfigError("rlhf.generation_batch_size",
                              f"{gbs} must be divisible by per_device_train_batch_size × nproc_per_node = "
                              f"{s.per_device_train_batch_size} × {nproc} = {global_batch}")
        env["NPROC_PER_NODE"] = str(nproc)
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        train_jsonl = config.data.train_jsonl
        if train_jsonl:
            env[SCHEMA_DATASET_ENV] = os.path.abspath(str(train_jsonl))
        return LaunchCommand(["swift", "rlhf", *to_argv(rlhf_arguments(config)), *extra], env)
    port = ["--master-port", str(master_port)] if master_port is not None else []
    resume = ["--resume-from-checkpoint", resume_from] if resume_from is not None else []
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *port,
            "-m", "trainer", "train", "--config", config_path, *resume, *extra]
    return LaunchCommand(argv, env)
