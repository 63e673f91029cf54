"""Names and labels of the children (docs/architecture.md, Kubernetes objects).

The router discovers engine pods by these labels, so they are a contract, not decoration:
the keys live in kubesgl.contract, which the router reads too.
"""

from __future__ import annotations

from collections.abc import Mapping

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
# holds an autoscaled Deployment's replicas while the operator lets go of them (reconcile.py)
REPLICAS_HANDOVER_MANAGER = "kubesgl-replicas-handover"


def selector_labels(instance: str, role: PodRole | None = None) -> dict[str, str]:
    """Labels that select an instance's pods (of one role); immutable once a Deployment exists."""
    labels = {NAME_LABEL: APP_NAME, INSTANCE_LABEL: instance}
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def object_labels(instance: str, role: PodRole | None = None) -> dict[str, str]:
    return {**selector_labels(instance, role), MANAGED_BY_LABEL: MANAGER}


# The operator's own keys: what selects pods, what the operator's watches select, and the role
# that pruning and teardown read (reconcile.py).
OWNED_LABELS = frozenset({NAME_LABEL, INSTANCE_LABEL, ROLE_LABEL, MANAGED_BY_LABEL})


def inherited_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The InferenceService's labels that its children carry too: all but the operator's own
    keys, which tools set on everything they apply (Helm's managed-by, Argo CD's instance)."""
    return {key: value for key, value in labels.items() if key not in OWNED_LABELS}


def role_object_name(instance: str, role: PodRole) -> str:
    return f"{instance}-{role}"


# The API server cuts a generateName at 63 - 5 characters before it appends 5 random ones.
GENERATED_NAME_PREFIX_MAX = 58


def pod_name_pattern(deployment: str) -> str:
    """A regex (anchored, as PromQL's =~ is) for the names of a Deployment's pods:
    `<deployment>-<pod-template-hash>-` cut at 58 characters, then 5 random characters. A long
    name loses the hash's end, its dash, or (57 characters and more) all of the hash. Names
    are DNS labels (letters, digits, dashes): nothing in them needs escaping, which a PromQL
    string would have to double."""
    if len(deployment) + 1 >= GENERATED_NAME_PREFIX_MAX:
        return f"{deployment}-"[:GENERATED_NAME_PREFIX_MAX] + "[a-z0-9]{5}"
    return f"{deployment}-[a-z0-9]+-?[a-z0-9]{{5}}"


def router_service_name(instance: str) -> str:
    """The client-facing Service is named like the InferenceService itself."""
    return instance


def router_endpoint(instance: str, namespace: str) -> str:
    return f"http://{router_service_name(instance)}.{namespace}.svc:{ROUTER_PORT}"
