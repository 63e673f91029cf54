"""One pure function from an InferenceService to the Kubernetes objects it becomes.

Same input, same output: no timestamps, hashes or random names, so that applying the result
again (an operator restart, a resync) changes nothing and starts no rollout.
"""

from __future__ import annotations

from kubesgl import contract
from kubesgl.operator.render.autoscaling import autoscaler
from kubesgl.operator.render.common import Object, pod_disruption_budget
from kubesgl.operator.render.engine import engine_deployment, headless_service
from kubesgl.operator.render.monitoring import pod_monitor
from kubesgl.operator.render.network import network_policies
from kubesgl.operator.render.router import (
    pod_reader_role,
    role_binding,
    router_deployment,
    router_service,
    service_account,
)
from kubesgl.operator.spec import InferenceService

__all__ = ["Object", "render"]


def render(isvc: InferenceService) -> list[Object]:
    """The children of a validated InferenceService, in the order they are best applied."""
    objects: list[Object] = [
        service_account(isvc),
        pod_reader_role(isvc),
        role_binding(isvc),
        *network_policies(isvc),  # before the pods they protect
    ]
    roles = isvc.spec.engine_roles()
    for role in roles:
        objects.append(headless_service(isvc, role))
    objects.append(router_service(isvc))
    for role, block in roles.items():
        objects.append(engine_deployment(isvc, role, block))
    objects.append(router_deployment(isvc))
    pod_roles: list[contract.PodRole] = [*roles, contract.ROUTER]
    for pod_role in pod_roles:
        objects.append(pod_disruption_budget(isvc, pod_role))
    for role in roles:
        scaler = autoscaler(isvc, role)
        if scaler is not None:
            objects.append(scaler)
    monitor = pod_monitor(isvc)
    if monitor is not None:
        objects.append(monitor)
    return objects
