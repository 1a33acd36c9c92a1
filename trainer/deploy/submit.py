"""Submit rendered manifests with the official ``kubernetes`` client (in-cluster credentials or a kubeconfig)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class SubmitError(RuntimeError):
    """Submission failed for a reason the user can act on (message says what to do)."""


def _client() -> Any:
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise SubmitError("the kubernetes client is not installed: pip install 'rollout-matching[kubernetes]' "
                          "(or print the specs with DRY_RUN=1)") from None
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except ConfigException as exc:
            raise SubmitError(f"running in a pod but its service-account credentials are unusable: {exc}") from None
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    try:
        config.load_kube_config()
    except (ConfigException, FileNotFoundError, OSError) as exc:
        raise SubmitError(
            f"no Kubernetes credentials: {exc} (looked for a kubeconfig at {kubeconfig} and for in-cluster "
            "service-account credentials). Set KUBECONFIG to a kubeconfig for the cluster, or print the specs "
            "instead with DRY_RUN=1 (or --dry-run)."
        ) from None
    return client.ApiClient()


def _is_custom(api_version: str) -> bool:
    """A CRD's group (``jobset.x-k8s.io``), not a built-in one (core, ``apps``, ``batch``, ``*.k8s.io``)."""
    group = api_version.split("/")[0] if "/" in api_version else ""
    return group.endswith("x-k8s.io") or ("." in group and not group.endswith(".k8s.io"))


def submit(manifests: list[dict[str, Any]], namespace: str) -> list[str]:
    """Create every manifest in order; returns ``kind/name`` of each. Stops at the first failure."""
    custom = sorted({d["kind"] for d in manifests if _is_custom(d.get("apiVersion", ""))})
    if custom:
        raise SubmitError(f"{', '.join(custom)} is a custom resource the kubernetes client cannot create from a dict; "
                          "print the manifests with DRY_RUN=1 and apply them with kubectl apply -f -")
    api = _client()
    from kubernetes import utils
    from kubernetes.client.exceptions import ApiException

    created = []
    for doc in manifests:
        ref = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            utils.create_from_dict(api, doc, namespace=namespace)
        except utils.FailToCreateError as exc:
            reasons = "; ".join(f"{e.status} {e.reason}: {getattr(e, 'body', '')}".strip() for e in exc.api_exceptions)
            hint = " (it exists already: delete the previous run, e.g. kubectl delete jobs,configmaps -l " \
                   f"rollout-matching/run={doc['metadata']['labels'].get('rollout-matching/run', '?')})" \
                if any(e.status == 409 for e in exc.api_exceptions) else ""
            raise SubmitError(f"creating {ref} in namespace {namespace} failed after {created or 'nothing'}: {reasons}{hint}") from None
        except (ApiException, OSError) as exc:
            raise SubmitError(f"creating {ref} in namespace {namespace} failed: {exc}") from None
        created.append(ref)
    return created
