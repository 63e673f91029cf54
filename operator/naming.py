"""Names, labels and annotations of the children (DESIGN.md, Kubernetes objects).

The router discovers engine pods by these labels, so they are a contract, not decoration.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "mixed", "router"]

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ROLE_LABEL = "kubesgl.io/role"
BOOTSTRAP_PORT_ANNOTATION = "kubesgl.io/bootstrap-port"

APP_NAME = "kubesgl"
MANAGER = "kubesgl-operator"  # the managed-by label and the server-side-apply field manager

ENGINE_PORT = 30000
BOOTSTRAP_PORT = 8998
ROUTER_PORT = 8000


def selector_labels(instance: str, role: Role | None = None) -> dict[str, str]:
    """Labels that select an instance's pods (of one role); immutable once a Deployment exists."""
    labels = {NAME_LABEL: APP_NAME, INSTANCE_LABEL: instance}
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def object_labels(instance: str, role: Role | None = None) -> dict[str, str]:
    return {**selector_labels(instance, role), MANAGED_BY_LABEL: MANAGER}


def role_object_name(instance: str, role: Role) -> str:
    return f"{instance}-{role}"


def router_service_name(instance: str) -> str:
    """The client-facing Service is named like the InferenceService itself."""
    return instance


def router_endpoint(instance: str, namespace: str) -> str:
    return f"http://{router_service_name(instance)}.{namespace}.svc:{ROUTER_PORT}"
