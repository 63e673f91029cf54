"""The router: a Deployment running `kubesgl router` with pod discovery, its client-facing
Service, and the narrowest RBAC that discovery needs (get, list, watch pods in one namespace)."""

from __future__ import annotations

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.render.common import (
    Object,
    container_security_context,
    http_probe,
    image_pull,
    metadata,
    placement,
    pod_metadata,
    pod_security_context,
    scrape_annotations,
    spread_over_nodes,
)
from kubesgl.operator.render.engine import (
    EXIT_SLACK_SECONDS,
    PRESTOP_SLEEP_SECONDS,
    PROGRESS_DEADLINE_SECONDS,
    api_key_env,
    prestop_pause,
    secret_env,
)
from kubesgl.operator.spec import InferenceService, RouterSpec
from kubesgl.router.config import ROUTER_OPTIONS
from kubesgl.router.options import options_of
from kubesgl.router.routing import DisaggregationSettings


def router_grace_period_seconds(shutdown_timeout_seconds: int) -> int:
    """The router pod's terminationGracePeriodSeconds. The kubelet counts it from the start of
    the preStop pause; after the pause, SIGTERM gives streams still running the router's
    --shutdown-timeout (the engines' spec.engine.shutdownTimeoutSeconds: the router cuts no
    stream its engine still drains), then the router exits (its prefill drains get 3 s of the
    slack, router/pd.py)."""
    return PRESTOP_SLEEP_SECONDS + shutdown_timeout_seconds + EXIT_SLACK_SECONDS


# The flags the operator sets and that its other objects rely on, each with why: extraArgs may
# not give them another value (validation.py).
ROUTER_OWNED_FLAGS = {
    "--host": "fixed: probes and the Service reach the pod on its own address",
    "--port": (f"fixed: probes, the Service and NetworkPolicies use {contract.ROUTER_PORT}"),
    "--kube-namespace": (
        "fixed: the engines run in the InferenceService's namespace, the one the router's "
        "Role lets it watch"
    ),
    "--kube-selector": "fixed: it selects this InferenceService's engine pods",
    "--shutdown-timeout": (
        "set spec.engine.shutdownTimeoutSeconds, which the engines' drain and the router pod's "
        "grace period follow"
    ),
}


# spec.router's router options: the fields named like a router flag, rendered when set (unset:
# the router's default), in the order of the router's declarations.
_SPEC_OPTIONS = [opt for opt in ROUTER_OPTIONS.values() if opt.dest in RouterSpec.model_fields]
# P/D routing's own: not used in mixed mode, as spec.kvTransfer is not
_PD_FLAGS = {opt.flag for opt in options_of(DisaggregationSettings)}


def surge_rollout() -> Object:
    """A rollout (a change of the spec, or an operator upgrade that renders the pod differently)
    starts each new router pod, and waits for it to be ready, before an old one stops: with
    Kubernetes' default a quarter of 4 or more routers stopped first, and new pods that cannot
    serve (an image older than the operator, refusing a flag it renders) then took serving
    routers down with them."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}


def router_args(isvc: InferenceService) -> list[str]:
    router = isvc.spec.router
    selectors = naming.selector_labels(isvc.metadata.name)
    args = [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(contract.ROUTER_PORT),
        "--policy",
        router.policy,
        "--kube-namespace",
        isvc.metadata.namespace,
        # streams get as long as their engines drain
        "--shutdown-timeout",
        str(isvc.spec.engine.shutdown_timeout_seconds),
    ]
    for key, value in selectors.items():
        args += ["--kube-selector", f"{key}={value}"]
    for opt in _SPEC_OPTIONS:
        value = getattr(router, opt.dest)
        if value is not None and (opt.flag not in _PD_FLAGS or isvc.spec.mode == "disaggregated"):
            args += [opt.flag, str(value)]
    return args + list(router.extra_args)


def _router_name(isvc: InferenceService) -> str:
    return naming.role_object_name(isvc.metadata.name, contract.ROUTER)


def service_account(isvc: InferenceService) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(isvc, _router_name(isvc), contract.ROUTER),
    }


def pod_reader_role(isvc: InferenceService) -> Object:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(isvc, _router_name(isvc), contract.ROUTER),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def role_binding(isvc: InferenceService) -> Object:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(isvc, _router_name(isvc), contract.ROUTER),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": _router_name(isvc),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": _router_name(isvc),
                "namespace": isvc.metadata.namespace,
            }
        ],
    }


def router_env(isvc: InferenceService) -> list[Object]:
    env: list[Object] = [{"name": "HOME", "value": "/tmp"}]
    # the key the router sends engines and checks clients against, the engines' own
    env += api_key_env(isvc)
    if isvc.spec.router.admin_key_secret is not None:
        env.append(secret_env(contract.ADMIN_KEY_ENV, isvc.spec.router.admin_key_secret))
    return env


def router_deployment(isvc: InferenceService) -> Object:
    router = isvc.spec.router
    instance = isvc.metadata.name
    pull, pod_pull = image_pull(isvc)
    container: Object = {
        "name": "router",
        "image": isvc.spec.image,
        **pull,
        "command": ["kubesgl"],
        "args": router_args(isvc),
        "env": router_env(isvc),
        "ports": [{"name": "http", "containerPort": contract.ROUTER_PORT}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "readinessProbe": http_probe("http", period=5, failures=2),
        # not /health: a router without a worker to serve (engines still loading, a pool down)
        # is unready, not broken, and a restart would only lose its prefix trees
        "livenessProbe": http_probe(
            "http", period=15, failures=4, timeout=5, path=contract.ROUTER_LIVENESS_PATH
        ),
        # uvicorn closes its listener at SIGTERM: clients still sent here would be refused
        "lifecycle": prestop_pause(),
        "securityContext": container_security_context(),
    }
    resources = router.resources.model_dump(by_alias=True)
    resources = {kind: values for kind, values in resources.items() if values}
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(isvc, _router_name(isvc), contract.ROUTER),
        "spec": {
            "replicas": router.replicas,
            "strategy": surge_rollout(),
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "selector": {"matchLabels": naming.selector_labels(instance, contract.ROUTER)},
            "template": {
                "metadata": pod_metadata(
                    isvc, contract.ROUTER, router, scrape_annotations(contract.ROUTER_PORT)
                ),
                "spec": {
                    "serviceAccountName": _router_name(isvc),
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    "terminationGracePeriodSeconds": router_grace_period_seconds(
                        isvc.spec.engine.shutdown_timeout_seconds
                    ),
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    **pod_pull,
                    **spread_over_nodes(isvc, contract.ROUTER),
                    **placement(router),
                },
            },
        },
    }


def router_service(isvc: InferenceService) -> Object:
    router = isvc.spec.router
    meta = metadata(isvc, naming.router_service_name(isvc.metadata.name), contract.ROUTER)
    if router.service_annotations:
        meta["annotations"] = dict(router.service_annotations)
    spec: Object = {
        "type": router.service_type,
        "selector": naming.selector_labels(isvc.metadata.name, contract.ROUTER),
        "ports": [
            {
                "name": "http",
                "port": contract.ROUTER_PORT,
                "targetPort": "http",
                "protocol": "TCP",
            }
        ],
    }
    if router.load_balancer_source_ranges:
        spec["loadBalancerSourceRanges"] = list(router.load_balancer_source_ranges)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}
