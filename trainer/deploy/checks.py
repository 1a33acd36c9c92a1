"""Topology checks over rendered manifests (Helm chart output or ``render-job`` output).

``check_manifests`` returns human-readable problems (empty when the deployment is coherent): every GPU pod on one
node's host network, node GPU sets disjoint and within the node, GPU requests/visible devices matching those sets,
rollout servers on loopback with unique ports and probes on the served health path, the learner waiting for every
server and working in a writable directory, the mounted training YAML naming the same servers, non-root
containers and a memory-backed /dev/shm, and every port any pod can open (``port_claims``) distinct across the
release and inside that pod's port block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from trainer.deploy.topology import LOOPBACK_HOSTS

SERVED_HEALTH_PATHS = ("/health/", "/health")
NODE_GPUS_ANNOTATION = "rollout-matching/node-gpus"
PORTS_ANNOTATION = "rollout-matching/ports"
# single ports a pod's processes bind, named by the environment variable that sets them
EXACT_PORT_ENV = ("VLLM_DP_MASTER_PORT", "MASTER_PORT", "PET_MASTER_PORT")
POD_KINDS = ("Pod", "Job", "Deployment", "StatefulSet", "DaemonSet")


@dataclass
class Workload:
    kind: str
    name: str
    component: str
    labels: dict[str, str]
    annotations: dict[str, str]
    pod: dict[str, Any]
    is_hook: bool = False

    @property
    def container(self) -> dict[str, Any]:
        return self.pod["containers"][0]

    @property
    def args(self) -> list[str]:
        return [str(a) for a in self.container.get("args") or []]

    @property
    def env(self) -> dict[str, str]:
        return {e["name"]: str(e.get("value", "")) for e in self.container.get("env") or []}

    @property
    def node_gpus(self) -> list[int]:
        raw = self.annotations.get(NODE_GPUS_ANNOTATION, "")
        return [int(x) for x in raw.split(",") if x.strip()]

    @property
    def port_block(self) -> tuple[int, int] | None:
        raw = self.annotations.get(PORTS_ANNOTATION)
        if not raw:
            return None
        first, last = raw.split("-")
        return int(first), int(last)

    def arg(self, flag: str) -> str | None:
        args = self.args
        return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def _workloads(manifests: list[dict[str, Any]]) -> list[Workload]:
    out = []
    for doc in manifests:
        kind = doc.get("kind")
        meta = doc.get("metadata") or {}
        if kind == "JobSet":  # gang scheduling: one Job per replicatedJob
            templates = [(f"{meta.get('name', '?')}/{rj.get('name', '?')}", rj["template"]["spec"]["template"])
                         for rj in (doc.get("spec") or {}).get("replicatedJobs") or []]
        elif kind in POD_KINDS:
            templates = [(meta.get("name", "?"), doc if kind == "Pod" else doc["spec"]["template"])]
        else:
            continue
        hook = "helm.sh/hook" in (meta.get("annotations") or {})
        for name, template in templates:
            template_meta = template.get("metadata") or {}
            labels = template_meta.get("labels") or {}
            out.append(Workload(kind=kind, name=name, component=labels.get("app.kubernetes.io/component", ""),
                                labels=labels, annotations=template_meta.get("annotations") or {},
                                pod=template["spec"], is_hook=hook))
    return out


def _same_node(w: Workload, workloads: list[Workload], node_selector: dict[str, str] | None) -> list[str]:
    """Pinned to the shared node: the same hostname selector, or required pod affinity on labels all pods carry."""
    sel = w.pod.get("nodeSelector") or {}
    if node_selector is not None and sel.get("kubernetes.io/hostname") == node_selector.get("kubernetes.io/hostname") \
            and "kubernetes.io/hostname" in sel:
        return []
    terms = (((w.pod.get("affinity") or {}).get("podAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")) or []
    for term in terms:
        match = (term.get("labelSelector") or {}).get("matchLabels") or {}
        if term.get("topologyKey") == "kubernetes.io/hostname" and match and all(
                all(o.labels.get(k) == v for k, v in match.items()) for o in workloads):
            return []
    return [f"{w.kind} {w.name}: not pinned to the shared node (nodeSelector kubernetes.io/hostname or required "
            "podAffinity on the release labels with topologyKey kubernetes.io/hostname)"]


@dataclass(frozen=True)
class PortClaim:
    """Ports ``first..last`` (inclusive) that ``owner`` may open, and why."""

    first: int
    last: int
    owner: str
    what: str

    def overlaps(self, other: PortClaim) -> bool:
        return self.first <= other.last and other.first <= self.last


def _train_config(manifests: list[dict[str, Any]]) -> dict[str, Any] | None:
    for doc in manifests:
        if doc.get("kind") == "ConfigMap" and "train.yaml" in (doc.get("data") or {}):
            return yaml.safe_load(doc["data"]["train.yaml"]) or {}
    return None


def _group_ports(config: dict[str, Any] | None, n_servers: int) -> list[int]:
    """The learner-side weight-sync ports (a TCPStore per server) the training config asks for."""
    if not config or not n_servers:
        return []
    rlhf = config.get("rlhf") if isinstance(config.get("rlhf"), dict) else None
    if rlhf is not None:
        return [int(p) for p in rlhf.get("vllm_server_group_port") or []]
    vllm = (((config.get("custom") or {}).get("extra") or {}).get("rollout_matching") or {}).get("vllm") or {}
    base = int((vllm.get("sync") or {}).get("group_port", 51216))
    return list(range(base, base + n_servers))


def port_claims(manifests: list[dict[str, Any]]) -> list[PortClaim]:
    """Every port a rendered pod can open on the node: the servers' HTTP ``--port``, the rendezvous ports
    (``VLLM_DP_MASTER_PORT``, ``MASTER_PORT``/``PET_MASTER_PORT``), the lifecycle ``--control-port``, vLLM's
    internal ports (from ``VLLM_PORT`` up to the end of the pod's port block: vLLM scans upward) and the learner's
    weight-sync group ports from the mounted training config."""
    claims: list[PortClaim] = []
    running = [w for w in _workloads(manifests) if not w.is_hook]
    n_servers = sum(w.component == "rollout-server" for w in running)
    for w in running:
        owner = f"{w.kind} {w.name}"
        env = w.env
        block = w.port_block
        if w.component == "rollout-server" and w.arg("--port"):
            port = int(w.arg("--port"))
            claims.append(PortClaim(port, port, owner, "HTTP --port"))
        if w.component == "rollout-server" and w.arg("--metrics-port"):
            port = int(w.arg("--metrics-port"))
            claims.append(PortClaim(port, port, owner, "metrics --metrics-port"))
        exact = {int(env[k]) for k in EXACT_PORT_ENV if env.get(k)}
        claims += [PortClaim(p, p, owner, "rendezvous (" + "/".join(k for k in EXACT_PORT_ENV if env.get(k) == str(p)) + ")")
                   for p in sorted(exact)]
        if w.arg("--control-port"):
            port = int(w.arg("--control-port"))
            claims.append(PortClaim(port, port, owner, "lifecycle --control-port"))
        if env.get("VLLM_PORT"):
            port = int(env["VLLM_PORT"])
            claims.append(PortClaim(port, max(port, block[1]) if block else port, owner, "VLLM_PORT (vLLM scans upward)"))
        if w.component == "learner":
            claims += [PortClaim(p, p, owner, "weight-sync group port") for p in _group_ports(_train_config(manifests), n_servers)]
            metrics_port = ((_train_config(manifests) or {}).get("training") or {}).get("metrics_port")
            if metrics_port:
                claims.append(PortClaim(int(metrics_port), int(metrics_port), owner, "metrics training.metrics_port"))
    return claims


#: ports the operator picks outside the port blocks
OUTSIDE_BLOCKS = ("HTTP --port", "metrics --metrics-port", "metrics training.metrics_port")


def check_ports(manifests: list[dict[str, Any]]) -> list[str]:
    """Port claims that collide (across pods, or two purposes in one pod) or leave the pod's port block."""
    problems = []
    blocks = {f"{w.kind} {w.name}": w.port_block for w in _workloads(manifests) if not w.is_hook}
    claims = port_claims(manifests)
    for c in claims:
        block = blocks.get(c.owner)
        if block and c.what not in OUTSIDE_BLOCKS and not (block[0] <= c.first and c.last <= block[1]):
            problems.append(f"{c.owner}: {c.what} {c.first}-{c.last} lies outside its port block {block[0]}-{block[1]}")
    for i, a in enumerate(claims):
        for b in claims[i + 1:]:
            if a.overlaps(b):
                problems.append(f"port collision: {a.owner} {a.what} {a.first}-{a.last} and {b.owner} {b.what} "
                                f"{b.first}-{b.last}")
    return problems


def _train_config_servers(manifests: list[dict[str, Any]]) -> list[str] | None:
    for doc in manifests:
        if doc.get("kind") == "ConfigMap" and "train.yaml" in (doc.get("data") or {}):
            cfg = yaml.safe_load(doc["data"]["train.yaml"]) or {}
            rlhf = cfg.get("rlhf") if isinstance(cfg.get("rlhf"), dict) else None
            if rlhf and rlhf.get("vllm_mode") == "server":
                hosts = rlhf.get("vllm_server_host") or []
                ports = rlhf.get("vllm_server_port") or []
                hosts = hosts if isinstance(hosts, list) else [hosts]
                ports = ports if isinstance(ports, list) else [ports]
                if len(hosts) == 1 and len(ports) > 1:
                    hosts = hosts * len(ports)
                return [f"http://{h}:{p}" for h, p in zip(hosts, ports)]
            vllm = (((cfg.get("custom") or {}).get("extra") or {}).get("rollout_matching") or {}).get("vllm") or {}
            if vllm.get("mode") == "server":
                return [str(s.get("base_url", "")).rstrip("/") for s in (vllm.get("server") or {}).get("servers") or []]
            return []
    return None


def check_manifests(manifests: list[dict[str, Any]], node_gpus: int, gpu_resource: str = "nvidia.com/gpu") -> list[str]:
    """Problems with the deployment these manifests describe; ``[]`` when it is coherent."""
    problems: list[str] = []
    workloads = _workloads(manifests)
    running = [w for w in workloads if not w.is_hook]
    servers = [w for w in running if w.component == "rollout-server"]
    learners = [w for w in running if w.component == "learner"]
    if len(learners) != 1:
        problems.append(f"expected exactly one learner workload, found {len(learners)}")

    hostnames = {(w.pod.get("nodeSelector") or {}).get("kubernetes.io/hostname") for w in running}
    shared_selector = {"kubernetes.io/hostname": next(iter(hostnames))} if len(hostnames) == 1 and None not in hostnames else None

    owner: dict[int, str] = {}
    for w in workloads:
        c = w.container
        if not w.pod.get("hostNetwork"):
            problems.append(f"{w.kind} {w.name}: hostNetwork must be true (servers listen on the node's loopback)")
        if w.pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
            problems.append(f"{w.kind} {w.name}: dnsPolicy must be ClusterFirstWithHostNet with hostNetwork")
        problems += _same_node(w, running, shared_selector)
        psc = w.pod.get("securityContext") or {}
        csc = c.get("securityContext") or {}
        if not psc.get("runAsNonRoot") or psc.get("runAsUser", 1) == 0:
            problems.append(f"{w.kind} {w.name}: must run as non-root (securityContext.runAsNonRoot: true)")
        if csc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{w.kind} {w.name}: allowPrivilegeEscalation must be false")
        if w.is_hook:
            continue

        ids = w.node_gpus
        if not ids:
            problems.append(f"{w.kind} {w.name}: no {NODE_GPUS_ANNOTATION} annotation naming its node GPUs")
        for g in ids:
            if g >= node_gpus:
                problems.append(f"{w.kind} {w.name}: GPU {g} does not exist on a {node_gpus}-GPU node")
            if g in owner:
                problems.append(f"{w.kind} {w.name}: GPU {g} is also used by {owner[g]}")
            owner[g] = f"{w.kind} {w.name}"
        limit = ((c.get("resources") or {}).get("limits") or {}).get(gpu_resource)
        env = w.env
        if limit is not None and int(limit) != len(ids):
            problems.append(f"{w.kind} {w.name}: requests {limit} {gpu_resource} but owns GPUs {ids}")
        if "NVIDIA_VISIBLE_DEVICES" in env and env["NVIDIA_VISIBLE_DEVICES"] != ",".join(map(str, ids)):
            problems.append(f"{w.kind} {w.name}: NVIDIA_VISIBLE_DEVICES={env['NVIDIA_VISIBLE_DEVICES']} but owns GPUs {ids}")
        if limit is None and "NVIDIA_VISIBLE_DEVICES" not in env:
            problems.append(f"{w.kind} {w.name}: neither a {gpu_resource} request nor NVIDIA_VISIBLE_DEVICES selects its GPUs")
        if env.get("CUDA_VISIBLE_DEVICES") != ",".join(str(i) for i in range(len(ids))):
            problems.append(f"{w.kind} {w.name}: CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} but the pod sees {len(ids)} GPU(s)")
        shm = [v for v in w.pod.get("volumes") or [] if (v.get("emptyDir") or {}).get("medium") == "Memory"]
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts") or []}
        if not any(mounts.get(v["name"]) == "/dev/shm" for v in shm):
            problems.append(f"{w.kind} {w.name}: /dev/shm must be a memory-backed emptyDir")

    if len(owner) > node_gpus:
        problems.append(f"the deployment uses {len(owner)} GPUs on a {node_gpus}-GPU node")

    urls: list[str] = []
    for w in servers:
        host, port = w.arg("--host"), w.arg("--port")
        if host not in LOOPBACK_HOSTS:
            problems.append(f"{w.kind} {w.name}: server must bind the loopback, got --host {host}")
        url = f"http://{host}:{port}"
        if url in urls:
            problems.append(f"{w.kind} {w.name}: port {port} is used by another server")
        urls.append(url)
        for probe_name in ("startupProbe", "readinessProbe"):
            probe = (w.container.get(probe_name) or {}).get("httpGet")
            if probe is None:
                problems.append(f"{w.kind} {w.name}: missing {probe_name} (httpGet on {SERVED_HEALTH_PATHS[0]})")
                continue
            if probe.get("path") not in SERVED_HEALTH_PATHS:
                problems.append(f"{w.kind} {w.name}: {probe_name} path {probe.get('path')} is not served (use {SERVED_HEALTH_PATHS[0]})")
            if str(probe.get("port")) != str(port):
                problems.append(f"{w.kind} {w.name}: {probe_name} port {probe.get('port')} != server --port {port}")
            if probe.get("host") != host:
                problems.append(f"{w.kind} {w.name}: {probe_name} host {probe.get('host')} != server --host {host}")

    for w in learners:
        c = w.container
        writable = {m["mountPath"] for m in c.get("volumeMounts") or [] if not m.get("readOnly")}
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") and c.get("workingDir") not in writable:
            problems.append(f"{w.kind} {w.name}: workingDir {c.get('workingDir')} is not a writable volume on a read-only "
                            "root filesystem (relative output paths would fail)")
        waited = [u for u in (w.arg("--wait-for-servers") or "").split(",") if u]
        if sorted(waited) != sorted(urls):
            problems.append(f"{w.kind} {w.name}: --wait-for-servers {waited} != the servers {urls}")
        if urls and not w.arg("--health-timeout-s"):
            problems.append(f"{w.kind} {w.name}: waiting for servers needs a deadline (--health-timeout-s)")
        nproc = w.arg("--nproc-per-node")
        ids = w.node_gpus
        if nproc is not None and int(nproc) != len(ids):
            problems.append(f"{w.kind} {w.name}: --nproc-per-node {nproc} but owns {len(ids)} GPU(s)")

    configured = _train_config_servers(manifests)
    if configured is not None and sorted(configured) != sorted(urls):
        problems.append(f"training config lists servers {configured} but the deployment runs {urls}")
    return problems + check_ports(manifests)
