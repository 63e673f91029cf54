"""Names and labels of the children (docs/architecture.md, Kubernetes objects).

The router discovers engine pods by these labels, so they are a contract, not decoration:
the keys live in kubesgl.contract, which the router reads too.
"""

from __future__ import annotations

from kubesgl.contract import (
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    ROLE_LABEL,
    ROUTER_PORT,
    PodRole,
)

APP_NAME = "kubesgl"
MANAGER = "kubesgl-operator"  # the managed-by label and the server-side-apply field manager


def selector_labels(instance: str, role: PodRole | None = None) -> dict[str, str]:
    """Labels that select an instance's pods (of one role); immutable once a Deployment exists."""
    labels = {NAME_LABEL: APP_NAME, INSTANCE_LABEL: instance}
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def object_labels(instance: str, role: PodRole | None = None) -> dict[str, str]:
    return {**selector_labels(instance, role), MANAGED_BY_LABEL: MANAGER}


def role_object_name(instance: str, role: PodRole) -> str:
    return f"{instance}-{role}"


def router_service_name(instance: str) -> str:
    """The client-facing Service is named like the InferenceService itself."""
    return instance


def router_endpoint(instance: str, namespace: str) -> str:
    return f"http://{router_service_name(instance)}.{namespace}.svc:{ROUTER_PORT}"
