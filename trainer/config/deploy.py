"""Config section ``deploy``: where and how ``render-job`` runs a training config on Kubernetes.

These fields become values of the Helm chart (``trainer.deploy.render.chart_values``), which owns the pod spec;
``values`` passes any other chart value through.

Every field has a default, so a training config without ``deploy:`` renders as-is: one GPU node, the
``rollout-matching/*`` images, host network, rollout servers on the first GPUs and the learner on the rest.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.config.base import Section

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([EPTGMK]i?|[mkMGTPE])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _dns_label(value: str, what: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(f"{what} {value!r} must be a DNS label: lowercase letters, digits and '-', at most 63 characters")
    return value


def _quantity(value: str) -> str:
    if not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 8, 500m, 16Gi)")
    return value


def _unique_gpus(ids: list[int] | None) -> list[int] | None:
    if ids is not None:
        dup = sorted({g for g in ids if ids.count(g) > 1})
        if dup:
            raise ValueError(f"GPU ids listed twice: {dup}")
        if any(g < 0 for g in ids):
            raise ValueError("GPU ids are 0-based node device indexes (>= 0)")
    return ids


class ImagesConfig(Section):
    rollout_server: str = "rollout-matching/rollout-server:0.1.0"
    learner: str = "rollout-matching/learner:0.1.0"
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[str] = Field(default_factory=list)


class HostVolume(Section):
    """A host directory mounted into the pods (models and datasets live on the GPU node)."""

    name: str
    host_path: str
    mount_path: str
    read_only: bool = True

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns_label(v, "volume name")

    @field_validator("host_path", "mount_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path")
        return v


class ResourcesConfig(Section):
    cpu: str = "4"
    memory: str = "32Gi"
    shm_size: str = "8Gi"

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _q(cls, v: str) -> str:
        return _quantity(v)


class ServerDeploy(Section):
    """Rollout-server pods. Unset sizes come from ``custom.extra.rollout_server`` (GRPO) or default to 1 GPU each."""

    engine: Literal["auto", "vllm", "swift", "hf", "scripted"] = "auto"
    model: str | None = None
    gpus: list[int] | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    data_parallel_size: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    max_model_len: int | None = Field(None, ge=16)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    startup_timeout_s: int = Field(1200, ge=10)
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        return _unique_gpus(v)


class LearnerDeploy(Section):
    """The learner pod. Without ``gpus``/``nproc_per_node`` it takes every node GPU the servers leave free."""

    gpus: list[int] | None = None
    nproc_per_node: int | None = Field(None, ge=1)
    health_timeout_s: float = Field(900.0, gt=0)
    resources: ResourcesConfig = Field(default_factory=lambda: ResourcesConfig(cpu="8", memory="64Gi", shm_size="32Gi"))
    backoff_limit: int = Field(2, ge=0, description="restarts of a failed learner pod, as the chart's "
                               "learner.backoffLimit: a stage-2 learner resumes from its newest complete checkpoint "
                               "(--resume auto), a GRPO one starts over; 0: a failure is final and the servers stop")
    active_deadline_s: int | None = Field(None, ge=1)
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        return _unique_gpus(v)

    @model_validator(mode="after")
    def _consistent(self) -> LearnerDeploy:
        if self.gpus is not None and self.nproc_per_node is not None and len(self.gpus) != self.nproc_per_node:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} but gpus lists {len(self.gpus)}; torchrun starts one process per GPU")
        return self


def _default_volumes() -> list[HostVolume]:
    return [
        HostVolume(name="models", host_path="/data/models", mount_path="/models"),
        HostVolume(name="data", host_path="/data/datasets", mount_path="/data"),
    ]


class DeployConfig(Section):
    """Deployment knobs for ``python -m trainer render-job`` (never read by training itself)."""

    name: str | None = None
    namespace: str = "default"
    node_name: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    service_account: str | None = None
    node_gpus: int = Field(8, ge=1, le=64)
    gpu_resource: str = "nvidia.com/gpu"
    gpu_assignment: Literal["device_plugin", "visible_devices"] = "device_plugin"
    host_ipc: bool = False
    run_as_user: int = Field(1000, ge=1)
    read_only_root_filesystem: bool = True
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    server: ServerDeploy = Field(default_factory=ServerDeploy)
    learner: LearnerDeploy = Field(default_factory=LearnerDeploy)
    volumes: list[HostVolume] = Field(default_factory=_default_volumes)
    output_host_path: str | None = None
    output_mount_path: str = "/output"
    # Merged over the chart's defaults (values.yaml `env`, `nccl.env`); a null value removes a default.
    env: dict[str, str | None] | None = None
    nccl_env: dict[str, str | None] | None = None
    # Any chart value (charts/rollout-matching/values.yaml), merged last: priorityClassName, caches, ports,
    # lifecycle, jobs.ttlSecondsAfterFinished, gang.queueName, gang.jobSet, rolloutServer.backoffLimit, …
    values: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else _dns_label(v, "deploy.name")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return _dns_label(v, "namespace")

    @field_validator("env", "nccl_env")
    @classmethod
    def _env_names(cls, v: dict[str, str | None] | None) -> dict[str, str | None] | None:
        bad = [k for k in v or {} if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"not valid environment variable names: {bad}")
        return v

    @model_validator(mode="after")
    def _unique_mounts(self) -> DeployConfig:
        names = [v.name for v in self.volumes]
        reserved = {"tmp", "cache", "dshm", "config", "output"}
        clash = sorted({n for n in names if names.count(n) > 1 or n in reserved})
        if clash:
            raise ValueError(f"volume names must be unique and not one of {sorted(reserved)}: {clash}")
        return self
