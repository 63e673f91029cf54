"""Pieces every rendered object shares: metadata with owner references, pod hardening, PDBs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    InferenceService,
    Placement,
)

Object = dict[str, Any]

# Engine and router images run as this unprivileged user (see the Dockerfile).
RUN_AS_USER = 1000


# $(VAR) in a container's command or args: the kubelet puts the container's variable there
ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_references(args: list[str], env: Mapping[str, str]) -> list[str]:
    """$(VAR) references to the variables in `env`, expanded as the kubelet does; a reference
    to another variable stays as it is."""
    return [ENV_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]


def labels(
    isvc: InferenceService,
    role: contract.PodRole | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A child's labels: the InferenceService's, the child's own from the spec over them (the
    PodMonitor's labels), then the operator's own over both. Pods: pod_metadata."""
    inherited = naming.inherited_labels(isvc.metadata.labels)
    return {**inherited, **(extra or {}), **naming.object_labels(isvc.metadata.name, role)}


def metadata(isvc: InferenceService, name: str, role: contract.PodRole | None = None) -> Object:
    meta: Object = {
        "name": name,
        "namespace": isvc.metadata.namespace,
        "labels": labels(isvc, role),
    }
    # Without a uid (a file given to `kubesgl render`) there is no owner to point at yet.
    if isvc.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": isvc.metadata.name,
                "uid": isvc.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def pod_security_context() -> Object:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        # not every file of a writable volume (a shared models PVC) at each pod start
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(add: tuple[str, ...] = ()) -> Object:
    """Every capability dropped, but those in `add` (an engine's IPC_LOCK for RDMA)."""
    capabilities: Object = {"drop": ["ALL"]}
    if add:
        capabilities = {"add": list(add), **capabilities}
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }


def scrape_annotations(port: int) -> dict[str, str]:
    """For Prometheus set-ups that discover pods by annotation rather than by PodMonitor."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


# The pod annotations the operator sets (scrape_annotations, a prefill pod's bootstrap port,
# which routers discover): spec.ROLE.podAnnotations may not name them (validation.py).
OWNED_POD_ANNOTATIONS = frozenset(
    {
        *scrape_annotations(0),
        contract.BOOTSTRAP_PORT_ANNOTATION,
        contract.SGLANG_BOOTSTRAP_PORT_ANNOTATION,
    }
)


def pod_metadata(
    isvc: InferenceService, role: contract.PodRole, block: Placement, annotations: dict[str, str]
) -> Object:
    """A pod template's labels and annotations: the block's own beside the operator's. Not the
    InferenceService's labels, which reach the children's metadata only: a change of the pod
    template restarts every pod, and Helm changes its chart and version labels with each
    upgrade (docs/operator.md, What an InferenceService becomes)."""
    return {
        "labels": {**block.pod_labels, **naming.object_labels(isvc.metadata.name, role)},
        "annotations": {**block.pod_annotations, **annotations},
    }


def http_probe(
    port_name: str, period: int, failures: int, timeout: int = 3, path: str = "/health"
) -> Object:
    return {
        "httpGet": {"path": path, "port": port_name},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def placement(block: Placement) -> Object:
    """Where a block's pods run: nodeSelector, tolerations, affinity, priority and runtime
    class of a pod spec, each left out when not given."""
    spec: Object = {}
    if block.node_selector:
        spec["nodeSelector"] = dict(block.node_selector)
    if block.tolerations:
        spec["tolerations"] = [as_given(toleration) for toleration in block.tolerations]
    if block.affinity:
        spec["affinity"] = block.affinity
    if block.priority_class_name:
        spec["priorityClassName"] = block.priority_class_name
    if block.runtime_class_name:
        spec["runtimeClassName"] = block.runtime_class_name
    return spec


# Where a role's pods preferably spread: over nodes, and over zones too, since pods that set
# constraints of their own lose the scheduler's default spreading (zones included).
SPREAD_TOPOLOGY_KEYS = ("kubernetes.io/hostname", "topology.kubernetes.io/zone")


def spread_over_nodes(isvc: InferenceService, role: contract.PodRole) -> Object:
    """A role's pods preferably on different nodes and zones, so that one going down takes
    one replica, not all; preferred, as a pod left Pending would serve nothing."""
    selector = {"matchLabels": naming.selector_labels(isvc.metadata.name, role)}
    constraints = [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
            # counted within one ReplicaSet: a rollout's old pods do not skew its new ones
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in SPREAD_TOPOLOGY_KEYS
    ]
    return {"topologySpreadConstraints": constraints}


def as_given(block: BaseModel) -> Object:
    """A block of the spec passed on to a pod (a toleration, an env variable), as written."""
    return block.model_dump(by_alias=True, exclude_none=True)


def image_pull(isvc: InferenceService) -> tuple[Object, Object]:
    """(container fields, pod fields) for the image pull policy and secrets."""
    container: Object = {}
    pod: Object = {}
    if isvc.spec.image_pull_policy:
        container["imagePullPolicy"] = isvc.spec.image_pull_policy
    if isvc.spec.image_pull_secrets:
        pod["imagePullSecrets"] = [
            {"name": secret if isinstance(secret, str) else secret.name}
            for secret in isvc.spec.image_pull_secrets
        ]
    return container, pod


def pod_disruption_budget(isvc: InferenceService, role: contract.PodRole) -> Object:
    name = naming.role_object_name(isvc.metadata.name, role)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(isvc, name, role),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": naming.selector_labels(isvc.metadata.name, role)},
            # a pod not ready (loading, crash-looping) serves nothing the budget protects, and
            # under the default policy, once the budget is spent, it blocked node drains
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
