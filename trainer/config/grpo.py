"""Config sections for summary GRPO (moved here from ``trainer/grpo/schema.py``: the schema package owns every
section; ``trainer.grpo`` imports it, never the reverse): ``rlhf.*`` (the ms-swift ``RLHFArguments`` subset our configs use) and
``custom.extra.rollout_server.*`` (how the ``swift rollout`` server is launched), plus the cross-key rules.

``check_grpo(cfg)`` returns every problem and warning; ``validate_grpo(cfg)`` raises the first problem as a
``ConfigError`` and returns the warnings. ``cfg`` is the typed root config (``TrainConfig``, whose field
validation already ran; typed here by the ``GrpoRoot`` protocol, so the import runs one way only: schema → grpo);
``trainer.config.schema.validate_config`` applies these rules to ``grpo_summary`` configs.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from trainer.config.base import Section
from trainer.config.errors import ConfigError

GRPO_VARIANT = "grpo_summary"

#: the summary rewards ``rlhf.reward_funcs`` may name; ``trainer.grpo.rewards.REWARDS`` implements exactly these
#: (checked at its import)
REWARD_NAMES: tuple[str, ...] = (
    "summary.format",
    "summary.header",
    "summary.strict",
    "summary.parse",
    "summary.no_dup_keys",
    "summary.dataset",
    "summary.category_recall",
    "summary.content_structured_tversky",
    "summary.text_bbu",
    "summary.notes_bbu",
    "summary.group_stats_presence",
    "summary.attr_key_recall",
    "summary.attr_path_recall",
    "summary.schema_tree",
)

#: trainer-side ``rlhf.*`` vLLM knobs that ms-swift ignores when it talks to an external ``swift rollout``
#: server, with the place that does take effect.
IGNORED_IN_SERVER_MODE: dict[str, str] = {
    "vllm_max_model_len": "custom.extra.rollout_server.vllm_max_model_len",
    "vllm_gpu_memory_utilization": "custom.extra.rollout_server.vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size": "custom.extra.rollout_server.vllm_tensor_parallel_size",
    "vllm_data_parallel_size": "custom.extra.rollout_server.vllm_data_parallel_size",
    "vllm_enable_lora": "custom.extra.rollout_server.vllm_enable_lora",
    "vllm_max_num_seqs": "custom.extra.rollout_server.vllm_max_num_seqs",
    "vllm_enable_prefix_caching": "custom.extra.rollout_server.vllm_enable_prefix_caching",
    "vllm_limit_mm_per_prompt": "custom.extra.rollout_server.vllm_limit_mm_per_prompt",
    "vllm_enforce_eager": "custom.extra.rollout_server.vllm_enforce_eager",
    "sleep_level": "nothing (server engines never sleep)",
    "offload_model": "nothing (colocate only)",
    "offload_optimizer": "nothing (colocate only)",
}


class RlhfConfig(Section):
    """ms-swift ``RLHFArguments`` fields, same names and meaning; ``None`` means "ms-swift's default"."""

    rlhf_type: Literal["grpo"] = "grpo"
    model_type: str | None = None
    template: str | None = None
    # rollout connectivity
    use_vllm: bool = True
    vllm_mode: Literal["server", "colocate"] | None = "server"
    vllm_server_host: list[str] = Field(default_factory=lambda: ["127.0.0.1"])
    vllm_server_port: list[int] = Field(default_factory=lambda: [8000])
    vllm_server_timeout: float = Field(240.0, gt=0)
    vllm_server_group_port: list[int] | None = None
    # colocate-only engine knobs (reported as ignored in server mode)
    vllm_max_model_len: int | None = Field(None, ge=16)
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    vllm_tensor_parallel_size: int | None = Field(None, ge=1)
    vllm_data_parallel_size: int | None = Field(None, ge=1)
    vllm_enable_lora: bool | None = None
    vllm_max_num_seqs: int | None = Field(None, ge=1)
    vllm_enable_prefix_caching: bool | None = None
    vllm_limit_mm_per_prompt: dict[str, int] | None = None
    vllm_enforce_eager: bool | None = None
    sleep_level: Literal[0, 1, 2] | None = None
    offload_model: bool | None = None
    offload_optimizer: bool | None = None
    # sampling
    num_generations: int = Field(8, ge=2)
    temperature: float = Field(0.9, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_completion_length: int = Field(512, ge=1)
    max_length: int | None = Field(None, ge=16)
    generation_batch_size: int | None = Field(None, ge=1)
    steps_per_generation: int | None = Field(None, ge=1)
    # objective
    beta: float = Field(0.04, ge=0.0)
    epsilon: float = Field(0.2, gt=0.0)
    epsilon_high: float | None = Field(None, gt=0.0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "real", "fipo"] | None = None
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    scale_rewards: Literal["group", "batch", "none", "gdpo"] | None = None
    kl_in_reward: bool | None = None
    num_iterations: int = Field(1, ge=1)
    dynamic_sample: bool = False
    max_resample_times: int = Field(3, ge=1)
    overlong_filter: bool = False
    truncation_strategy: Literal["left", "delete"] | None = None
    # rewards
    reward_funcs: list[str] = Field(default_factory=list)
    reward_weights: list[float] | None = None
    log_completions: bool = False
    async_generate: bool = False

    @field_validator("vllm_server_host")
    @classmethod
    def _hosts_non_empty(cls, v: list[str]) -> list[str]:
        if not v or any(not h.strip() for h in v):
            raise ValueError("must be a non-empty list of host names, e.g. [127.0.0.1]")
        return v

    @field_validator("vllm_server_port")
    @classmethod
    def _ports_valid(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("must be a non-empty list of ports, e.g. [8080]")
        bad = [p for p in v if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"ports must be in 1..65535, got {bad}")
        return v


class RolloutServerConfig(Section):
    """How ``python -m trainer launch server --engine swift`` starts ``swift rollout`` for this config.

    ``host``/``port`` default to the first ``rlhf.vllm_server_host``/``vllm_server_port`` entry; ``gpus`` are the
    server's device indices (``TP × DP`` of them), ``learner_gpus`` the learner's (disjoint).
    """

    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_data_parallel_size: int = Field(1, ge=1)
    vllm_max_model_len: int = Field(..., ge=16)
    vllm_gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0)
    vllm_enable_lora: bool = False
    vllm_max_num_seqs: int | None = Field(None, ge=1)
    vllm_enable_prefix_caching: bool | None = None
    vllm_limit_mm_per_prompt: dict[str, int] | None = None
    vllm_enforce_eager: bool | None = None
    vllm_use_async_engine: bool | None = None
    host: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    gpus: list[int] | None = None
    learner_gpus: list[int] | None = None

    @field_validator("gpus", "learner_gpus")
    @classmethod
    def _gpu_list(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one GPU index (or be omitted)")
        if any(g < 0 for g in v):
            raise ValueError(f"GPU indices must be >= 0, got {v}")
        if len(set(v)) != len(v):
            raise ValueError(f"GPU indices must be unique, got {v}")
        return v

    @property
    def world_size(self) -> int:
        return self.vllm_tensor_parallel_size * self.vllm_data_parallel_size


class _Tuner(Protocol):
    @property
    def train_type(self) -> str: ...


class _Training(Protocol):
    @property
    def per_device_train_batch_size(self) -> int: ...


class _Extra(Protocol):
    @property
    def rollout_server(self) -> RolloutServerConfig | None: ...


class _Custom(Protocol):
    @property
    def trainer_variant(self) -> str: ...

    @property
    def extra(self) -> _Extra: ...


class GrpoRoot(Protocol):
    """What the rules below read of the typed root config (``trainer.config.schema.TrainConfig`` has it): a
    structural type, so this module never imports the root schema, which imports it (read-only members: any
    section with these fields fits)."""

    @property
    def rlhf(self) -> RlhfConfig | None: ...

    @property
    def custom(self) -> _Custom: ...

    @property
    def tuner(self) -> _Tuner: ...

    @property
    def training(self) -> _Training: ...


@dataclass(frozen=True)
class GrpoSections:
    """The parts of a config that summary GRPO reads, typed; the rest of the config stays the lead schema's."""

    rlhf: RlhfConfig
    rollout_server: RolloutServerConfig | None
    trainer_variant: str | None
    train_type: str = "full"
    per_device_train_batch_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def grpo_sections(cfg: GrpoRoot) -> GrpoSections:
    """The GRPO sections of the typed root config (raises ``ConfigError`` when ``rlhf`` is absent)."""
    if cfg.rlhf is None:
        raise ConfigError("rlhf", f"required when custom.trainer_variant is {GRPO_VARIANT}")
    return GrpoSections(
        rlhf=cfg.rlhf,
        rollout_server=cfg.custom.extra.rollout_server,
        trainer_variant=cfg.custom.trainer_variant,
        train_type=cfg.tuner.train_type,
        per_device_train_batch_size=cfg.training.per_device_train_batch_size,
    )


def is_local_host(host: str) -> bool:
    """True for loopback names and addresses (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def server_endpoint(sections: GrpoSections) -> tuple[str, int]:
    """The (host, port) the rollout server binds: ``rollout_server.host/port`` or the first ``rlhf`` entry."""
    rs = sections.rollout_server
    host = (rs.host if rs and rs.host else None) or sections.rlhf.vllm_server_host[0]
    port = (rs.port if rs and rs.port else None) or sections.rlhf.vllm_server_port[0]
    return host, port


def server_urls(sections: GrpoSections) -> list[str]:
    """Base URLs the learner connects to (``rlhf.vllm_server_host`` × ``vllm_server_port``, paired)."""
    r = sections.rlhf
    return [f"http://{_url_host(h)}:{p}" for h, p in zip(r.vllm_server_host, r.vllm_server_port)]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _server_rules(s: GrpoSections, errors: list[ConfigError], warnings: list[str]) -> None:
    r, rs = s.rlhf, s.rollout_server
    if not r.use_vllm:
        errors.append(ConfigError("rlhf.use_vllm", "must be true when rlhf.vllm_mode is server"))
    if rs is None:
        errors.append(ConfigError(
            "custom.extra.rollout_server",
            "required when rlhf.vllm_mode is server: set vllm_tensor_parallel_size, vllm_data_parallel_size, "
            "vllm_max_model_len, vllm_gpu_memory_utilization, vllm_enable_lora: false"))
        return
    if len(r.vllm_server_host) != len(r.vllm_server_port):
        errors.append(ConfigError(
            "rlhf.vllm_server_port",
            f"{len(r.vllm_server_port)} port(s) for {len(r.vllm_server_host)} host(s); give one port per host"))
    elif len(r.vllm_server_host) != 1:
        errors.append(ConfigError(
            "rlhf.vllm_server_host",
            f"single-node v1 launches one rollout server (DP spreads it over its GPUs); got "
            f"{len(r.vllm_server_host)} servers"))
    remote = [h for h in r.vllm_server_host if not is_local_host(h)]
    if remote:
        errors.append(ConfigError(
            "rlhf.vllm_server_host",
            f"single-node v1 requires local hosts (127.0.0.1, localhost, ::1); got {remote}"))
    if rs.host is not None and not is_local_host(rs.host):
        errors.append(ConfigError("custom.extra.rollout_server.host",
                                  f"must be a loopback address on a single node, got {rs.host!r}"))
    if rs.host is not None and r.vllm_server_host and rs.host != r.vllm_server_host[0]:
        errors.append(ConfigError("custom.extra.rollout_server.host",
                                  f"{rs.host!r} differs from rlhf.vllm_server_host[0] {r.vllm_server_host[0]!r}: "
                                  "the learner would connect elsewhere; drop one or make them equal"))
    if rs.port is not None and r.vllm_server_port and rs.port != r.vllm_server_port[0]:
        errors.append(ConfigError("custom.extra.rollout_server.port",
                                  f"{rs.port} differs from rlhf.vllm_server_port[0] {r.vllm_server_port[0]}: "
                                  "the learner would connect elsewhere; drop one or make them equal"))
    if rs.vllm_enable_lora:
        errors.append(ConfigError(
            "custom.extra.rollout_server.vllm_enable_lora",
            "must be false: multimodal DoRA (ViT/aligner trainable) trains with full-weight sync to the server"))
    if rs.vllm_max_model_len <= r.max_completion_length:
        errors.append(ConfigError(
            "custom.extra.rollout_server.vllm_max_model_len",
            f"{rs.vllm_max_model_len} leaves no room for the prompt with rlhf.max_completion_length="
            f"{r.max_completion_length}; raise vllm_max_model_len or lower max_completion_length"))
    elif r.max_length is not None and r.max_length > rs.vllm_max_model_len:
        errors.append(ConfigError(
            "rlhf.max_length",
            f"{r.max_length} exceeds the server's custom.extra.rollout_server.vllm_max_model_len="
            f"{rs.vllm_max_model_len} (the source of truth); sequences the learner accepts would fail at the server"))
    _gpu_rules(s, rs, errors)
    for key, where in IGNORED_IN_SERVER_MODE.items():
        value = getattr(r, key)
        if value is not None:
            warnings.append(f"rlhf.{key}={value!r} is ignored by ms-swift for an external rollout server; "
                            f"set it in {where}")


def _gpu_rules(s: GrpoSections, rs: RolloutServerConfig, errors: list[ConfigError]) -> None:
    if rs.gpus is not None and len(rs.gpus) != rs.world_size:
        errors.append(ConfigError(
            "custom.extra.rollout_server.gpus",
            f"{len(rs.gpus)} GPU(s) {rs.gpus} but the server needs tensor_parallel_size × data_parallel_size = "
            f"{rs.vllm_tensor_parallel_size} × {rs.vllm_data_parallel_size} = {rs.world_size}"))
    if rs.gpus is not None and rs.learner_gpus is not None:
        shared = sorted(set(rs.gpus) & set(rs.learner_gpus))
        if shared:
            errors.append(ConfigError(
                "custom.extra.rollout_server.learner_gpus",
                f"GPU(s) {shared} are also rollout-server GPUs; server and learner GPU sets must be disjoint"))
    if rs.learner_gpus is not None:
        world = len(rs.learner_gpus)
        global_batch = s.per_device_train_batch_size * world
        gbs = s.rlhf.generation_batch_size
        if gbs is not None and gbs % global_batch:
            errors.append(ConfigError(
                "rlhf.generation_batch_size",
                f"{gbs} must be divisible by per_device_train_batch_size × learner GPUs = "
                f"{s.per_device_train_batch_size} × {world} = {global_batch}"))


def check_grpo(cfg: GrpoRoot) -> tuple[list[ConfigError], list[str]]:
    """Every summary-GRPO problem (``ConfigError`` with key path) and warning in the typed ``cfg`` (its sections
    already passed field validation; ``validate_config`` calls this for ``grpo_summary`` configs)."""
    try:
        s = grpo_sections(cfg)
    except ConfigError as exc:
        return [exc], []
    errors: list[ConfigError] = []
    warnings: list[str] = []
    r = s.rlhf
    if s.trainer_variant not in (None, GRPO_VARIANT):
        errors.append(ConfigError("custom.trainer_variant",
                                  f"{s.trainer_variant!r} does not run GRPO; set it to {GRPO_VARIANT}"))
    if not r.reward_funcs:
        errors.append(ConfigError("rlhf.reward_funcs", "GRPO needs at least one reward function, e.g. [summary.format]"))
    dup = sorted({f for f in r.reward_funcs if r.reward_funcs.count(f) > 1})
    if dup:
        errors.append(ConfigError("rlhf.reward_funcs", f"listed more than once: {dup}"))
    if r.reward_weights is not None and len(r.reward_weights) != len(r.reward_funcs):
        errors.append(ConfigError(
            "rlhf.reward_weights",
            f"{len(r.reward_weights)} weight(s) for {len(r.reward_funcs)} reward function(s); give one per function"))
    unknown = [f for f in r.reward_funcs if f.startswith("summary.") and f not in REWARD_NAMES]
    if unknown:
        errors.append(ConfigError("rlhf.reward_funcs",
                                  f"unknown summary reward(s) {unknown}; known: {', '.join(REWARD_NAMES)}"))
    if r.generation_batch_size is not None and r.generation_batch_size % r.num_generations:
        errors.append(ConfigError(
            "rlhf.generation_batch_size",
            f"{r.generation_batch_size} must be divisible by rlhf.num_generations={r.num_generations}"))
    if r.vllm_mode is not None and not r.use_vllm:
        errors.append(ConfigError("rlhf.vllm_mode", "set rlhf.use_vllm: true, or drop vllm_mode"))
    if r.use_vllm and r.vllm_mode is None:
        errors.append(ConfigError("rlhf.vllm_mode", "required when rlhf.use_vllm is true: server or colocate"))
    if r.async_generate and r.vllm_mode != "server":
        errors.append(ConfigError("rlhf.async_generate", "requires rlhf.vllm_mode: server"))
    if r.vllm_mode == "server":
        _server_rules(s, errors, warnings)
    elif s.rollout_server is not None:
        warnings.append(f"custom.extra.rollout_server is only used when rlhf.vllm_mode is server "
                        f"(it is {r.vllm_mode!r}); it is ignored")
    return errors, warnings


def validate_grpo(cfg: GrpoRoot) -> list[str]:
    """Raise the first summary-GRPO problem as ``ConfigError``; return the warnings."""
    errors, warnings = check_grpo(cfg)
    if errors:
        raise errors[0]
    return warnings
