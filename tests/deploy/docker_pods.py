"""Run rendered Kubernetes pod specs as Docker containers (testcontainers), as the kubelet would on one node.

Kept: image, command (replaces the image entrypoint) and args, workingDir, env, host network, user/group,
read-only root filesystem, dropped capabilities, no-new-privileges, emptyDirs (as on a node: a host directory
writable by the pod's uid, as fsGroup makes it; ``medium: Memory`` as tmpfs, /dev/shm as the shm size),
hostPaths (bind mounts) and ConfigMaps (their data written to files, bind-mounted read-only). GPU resources have
no Docker analogue here.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

import httpx  # noqa: E402
from testcontainers.core.container import DockerContainer  # noqa: E402

_QUANTITY = re.compile(r"^(\d+)([KMGT]i?)?$")


def docker_size(quantity: str) -> str:
    """A Kubernetes quantity (``8Gi``) as a Docker size (``8g``)."""
    match = _QUANTITY.match(str(quantity))
    if not match:
        raise ValueError(f"unsupported quantity {quantity!r}")
    unit = (match.group(2) or "").rstrip("i").lower()
    return f"{match.group(1)}{unit or 'b'}"




def write_configmaps(manifests: list[dict[str, Any]], root: Path) -> dict[str, Path]:
    """Each ConfigMap's data as files under ``root/<name>/`` (world-readable: pods run as a non-root uid)."""
    out = {}
    for doc in manifests:
        if doc.get("kind") != "ConfigMap":
            continue
        directory = root / doc["metadata"]["name"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in (doc.get("data") or {}).items():
            (directory / key).write_text(text)
            (directory / key).chmod(0o644)
        directory.chmod(0o755)
        out[doc["metadata"]["name"]] = directory
    return out


def pod_container(pod: dict[str, Any], configmaps: dict[str, Path], name: str, scratch: Path) -> DockerContainer:
    """A container configured like the pod's first container; emptyDirs live under ``scratch/name/``."""
    c = pod["containers"][0]
    ctr = DockerContainer(c["image"], name=name)
    ctr.with_command([str(a) for a in c.get("args") or []])
    for e in c.get("env") or []:
        ctr.with_env(e["name"], str(e["value"]))
    psc, csc = pod.get("securityContext") or {}, c.get("securityContext") or {}
    kwargs: dict[str, Any] = {}
    if c.get("workingDir"):
        kwargs["working_dir"] = c["workingDir"]
    if c.get("command"):
        kwargs["entrypoint"] = [str(a) for a in c["command"]]
    if pod.get("hostNetwork"):
        kwargs["network_mode"] = "host"
    if "runAsUser" in psc:
        kwargs["user"] = f"{psc['runAsUser']}:{psc.get('runAsGroup', psc['runAsUser'])}"
    if csc.get("readOnlyRootFilesystem"):
        kwargs["read_only"] = True
    if (csc.get("capabilities") or {}).get("drop"):
        kwargs["cap_drop"] = list(csc["capabilities"]["drop"])
    if csc.get("allowPrivilegeEscalation") is False:
        kwargs["security_opt"] = ["no-new-privileges"]
    if pod.get("hostIPC"):
        kwargs["ipc_mode"] = "host"
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for m in c.get("volumeMounts") or []:
        v = volumes[m["name"]]
        if "emptyDir" in v:
            size = (v["emptyDir"] or {}).get("sizeLimit")
            if m["mountPath"] == "/dev/shm":
                kwargs["shm_size"] = docker_size(size or "64Mi")
            elif (v["emptyDir"] or {}).get("medium") == "Memory":
                ctr.with_tmpfs_mount(m["mountPath"], "mode=1777" + (f",size={docker_size(size)}" if size else ""))
            else:
                directory = scratch / name / m["name"]
                directory.mkdir(parents=True, exist_ok=True)
                directory.chmod(0o777)
                ctr.with_volume_mapping(str(directory), m["mountPath"], "rw")
        elif "hostPath" in v:
            path = v["hostPath"]["path"]
            if v["hostPath"].get("type") == "Directory" and not os.path.isdir(path):
                raise FileNotFoundError(f"hostPath {path} of volume {m['name']} does not exist")
            ctr.with_volume_mapping(path, m["mountPath"], "ro" if m.get("readOnly") else "rw")
        elif "configMap" in v:
            ctr.with_volume_mapping(str(configmaps[v["configMap"]["name"]]), m["mountPath"], "ro")
        else:
            raise ValueError(f"volume {m['name']}: no Docker mapping for {sorted(v)}")
    ctr.with_kwargs(**kwargs)
    return ctr


def wait_healthy(url: str, container: DockerContainer, timeout_s: float = 600.0, path: str = "/health/") -> None:
    """Poll ``url + path`` until 200; fail with the container's logs when it exits or the deadline passes (which
    bounds a hang only: a server that fails to start exits, and that ends the wait at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        container.get_wrapped_container().reload()
        if container.get_wrapped_container().status == "exited":
            break
        time.sleep(0.5)
    out, err = container.get_logs()
    raise AssertionError(f"{url}{path} never became healthy; container logs:\n{out.decode()}\n{err.decode()}")


def logs(container: DockerContainer) -> str:
    out, err = container.get_logs()
    return out.decode(errors="replace") + err.decode(errors="replace")
