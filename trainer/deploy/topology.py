"""Which pods a training config needs on its GPU node: rollout servers (server mode) and the learner.

This is the plan only (how many servers, their ports, sizes and node GPU ids, with errors naming the config key
to change); the pods themselves come from the Helm chart (``trainer.deploy.render``).

``plan_topology`` is pure: the validated, typed training config (``trainer.config.schema.validate_config``) +
``DeployConfig`` → ``Topology``; it reads attributes, never dotted key strings (the schema owns the config paths).
Server mode is read from the stage-2 section (``rollout_matching.vllm.mode: server`` + its server list, see
``VllmServerConfig.base_urls``) or the GRPO section (``rlhf.vllm_mode: server`` + ``vllm_server_host``/``port``);
server sizes and GPU ids come from ``deploy.server``/``deploy.learner`` first, then
``custom.extra.rollout_server.{vllm_*, gpus, learner_gpus}``, then the defaults: one GPU per server, servers on the
first GPUs, the learner on the rest of the node. Error keys name the config key to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from trainer.config.deploy import DeployConfig
from trainer.config.errors import ConfigError
from trainer.config.grpo import GRPO_VARIANT
from trainer.config.schema import TrainConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSpec:
    index: int
    host: str
    port: int
    gpus: tuple[int, ...]
    engine: str
    model: str | None
    tensor_parallel_size: int
    data_parallel_size: int
    gpu_memory_utilization: float | None
    max_model_len: int | None
    enable_lora: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class LearnerSpec:
    gpus: tuple[int, ...]
    wait_for: tuple[str, ...]
    health_timeout_s: float

    @property
    def nproc_per_node(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class Topology:
    name: str
    workload: str  # "stage2" | "grpo"
    servers: tuple[ServerSpec, ...]
    learner: LearnerSpec

    @property
    def gpus_used(self) -> int:
        return sum(len(s.gpus) for s in self.servers) + len(self.learner.gpus)


def job_name(config_path: str, deploy: DeployConfig) -> str:
    """``deploy.name`` or the config file's stem as a DNS label (``summary_1024.yaml`` → ``summary-1024``)."""
    if deploy.name:
        return deploy.name
    stem = re.sub(r"\.ya?ml$", "", config_path.replace("\\", "/").rsplit("/", 1)[-1])
    slug = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:40].strip("-")
    if not slug:
        raise ConfigError("deploy.name", f"cannot derive a job name from {config_path!r}; set deploy.name")
    return slug


def _endpoints(config: TrainConfig) -> tuple[str, list[tuple[str, int]], str]:
    """(workload, [(host, port)], key path of the server list); no endpoints when not in server mode."""
    workload = "grpo" if config.custom.trainer_variant == GRPO_VARIANT else "stage2"
    rm = config.custom.extra.rollout_matching
    if rm is not None and rm.rollout_backend == "vllm" and rm.vllm.mode == "server":
        key = "custom.extra.rollout_matching.vllm.server.servers"
        urls = rm.vllm.server.base_urls()
        if not urls:
            raise ConfigError(key, "server mode needs at least one server: servers: [{base_url: http://127.0.0.1:8000}]")
        endpoints = []
        for i, url in enumerate(urls):
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme != "http" or not parts.hostname or port is None:
                raise ConfigError(f"{key}[{i}].base_url", f"{url!r} must look like http://127.0.0.1:8000 (host and port)")
            endpoints.append((parts.hostname, port))
        return workload, endpoints, key
    r = config.rlhf
    if r is not None and r.vllm_mode == "server":
        if len(r.vllm_server_host) != len(r.vllm_server_port):
            raise ConfigError("rlhf.vllm_server_port", f"{len(r.vllm_server_port)} port(s) for "
                                                       f"{len(r.vllm_server_host)} host(s); give one port per host")
        return workload, list(zip(r.vllm_server_host, r.vllm_server_port)), "rlhf.vllm_server_host"
    return workload, [], ""


def _model_path(config: TrainConfig) -> str | None:
    """``model.path`` (``None`` for the embedded tiny model, which has no directory a server could load)."""
    return config.model.path


def plan_topology(config: TrainConfig, deploy: DeployConfig, name: str) -> Topology:
    """The pods the validated ``config`` needs; raises ``ConfigError`` (with the key to change) when they cannot fit the node."""
    workload, endpoints, key = _endpoints(config)
    for i, (host, port) in enumerate(endpoints):
        if host not in LOOPBACK_HOSTS:
            raise ConfigError(key, f"server {i} is {host}:{port}; render-job runs servers beside the learner on one "
                                   "node's host network, so hosts must be 127.0.0.1")
    ports = [p for _, p in endpoints]
    dup = sorted({p for p in ports if ports.count(p) > 1})
    if dup:
        raise ConfigError(key, f"port(s) {dup} listed more than once; every server on the node needs its own port")

    rs = config.custom.extra.rollout_server
    rm = config.custom.extra.rollout_matching
    sd = deploy.server
    tp = sd.tensor_parallel_size or (rs.vllm_tensor_parallel_size if rs else 1)
    dp = sd.data_parallel_size or (rs.vllm_data_parallel_size if rs else 1)
    per_server = tp * dp
    n_server_gpus = per_server * len(endpoints)
    engine = sd.engine if sd.engine != "auto" else ("swift" if workload == "grpo" else "vllm")
    model = sd.model or _model_path(config)
    if endpoints and dp > 1 and engine != "swift":
        raise ConfigError("deploy.server.engine", f"data parallel size {dp} needs engine swift (`trainer serve` runs "
                                                  "one engine per server; list one server per GPU group instead)")
    if endpoints and engine in ("vllm", "swift") and not model:
        raise ConfigError("deploy.server.model", f"engine {engine} needs a model directory: set model.path or deploy.server.model")

    server_gpu_key, listed = ("deploy.server.gpus", sd.gpus) if sd.gpus is not None else \
        ("custom.extra.rollout_server.gpus", rs.gpus if rs and endpoints else None)
    if listed is not None:
        if len(listed) != n_server_gpus:
            raise ConfigError(server_gpu_key, f"lists {len(listed)} GPUs but {len(endpoints)} server(s) × "
                                              f"TP {tp} × DP {dp} need {n_server_gpus}")
        server_gpus = list(listed)
    else:
        server_gpus = list(range(n_server_gpus))

    ld = deploy.learner
    learner_listed = ld.gpus if ld.gpus is not None else (rs.learner_gpus if rs and endpoints else None)
    if learner_listed is not None:
        learner_gpus = list(learner_listed)
        if ld.nproc_per_node is not None and ld.nproc_per_node != len(learner_gpus):
            raise ConfigError("deploy.learner.nproc_per_node", f"{ld.nproc_per_node} process(es) for the learner GPUs "
                                                               f"{learner_gpus}; torchrun starts one process per GPU")
    else:
        free = [g for g in range(deploy.node_gpus) if g not in server_gpus]
        want = ld.nproc_per_node or len(free)
        if want < 1 or want > len(free):
            raise ConfigError("deploy.learner.nproc_per_node",
                              f"the learner needs {want} GPU(s) but the servers leave {len(free)} of deploy.node_gpus={deploy.node_gpus}")
        learner_gpus = free[:want]

    clash = sorted(set(server_gpus) & set(learner_gpus))
    if clash:
        raise ConfigError("deploy.learner.gpus", f"GPU(s) {clash} are also rollout-server GPUs; device sets must be disjoint")
    too_high = sorted(g for g in server_gpus + learner_gpus if g >= deploy.node_gpus)
    if too_high:
        raise ConfigError("deploy.node_gpus", f"GPU id(s) {too_high} do not exist on a node with {deploy.node_gpus} GPUs")

    servers = tuple(
        ServerSpec(
            index=i,
            host=host,
            port=port,
            gpus=tuple(server_gpus[i * per_server:(i + 1) * per_server]),
            engine=engine,
            model=model,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            gpu_memory_utilization=sd.gpu_memory_utilization or (rs.vllm_gpu_memory_utilization if rs else None),
            max_model_len=sd.max_model_len or (rs.vllm_max_model_len if rs else None)
            or (rm.vllm.max_model_len if rm else None),
            enable_lora=bool(rs and rs.vllm_enable_lora),
        )
        for i, (host, port) in enumerate(endpoints)
    )
    learner = LearnerSpec(gpus=tuple(learner_gpus), wait_for=tuple(s.url for s in servers),
                          health_timeout_s=ld.health_timeout_s)
    return Topology(name=name, workload=workload, servers=servers, learner=learner)
