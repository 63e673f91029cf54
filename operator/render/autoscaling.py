"""Autoscalers for engine roles: an autoscaling/v2 HPA on pod metrics, or a KEDA ScaledObject
with a Prometheus trigger. Either one then owns the role's replica count, scaling up no faster
than behavior() allows."""

from __future__ import annotations

import copy
from decimal import Decimal

from kubesgl.contract import EngineRole
from kubesgl.operator import naming
from kubesgl.operator.render.common import Object, metadata
from kubesgl.operator.spec import AutoscalingSpec, InferenceService, RoleAutoscaling

# Engine gauges by spec metric name (docs/architecture.md, Metrics). For the HPA they are
# per-pod metrics served by a metrics adapter, but for kvCacheUsage; the prometheus-adapter rules
# for all four are charts/kubesgl/prometheus-adapter-values.yaml.
HPA_METRICS = {
    "waitingRequests": "kubesgl_num_waiting_requests",
    "runningRequests": "kubesgl_num_running_requests",
    "kvCacheUsage": "kubesgl_kv_cache_usage_ratio",
    "timeToFirstToken": "kubesgl_time_to_first_token_seconds_avg",
}
# Metrics whose fullest pod decides, not the average: one pod with a saturated KV pool refuses
# admission however idle the others are. The HPA reads the maximum over the role's pods as an
# External metric (the adapter's external rule), KEDA queries max().
MAX_OVER_PODS = {"kvCacheUsage": "kubesgl_kv_cache_usage_ratio_max"}
# The Prometheus label the PodMonitor copies from the pods' app.kubernetes.io/instance.
INSTANCE_PROMETHEUS_LABEL = "app_kubernetes_io_instance"


# The HPA's scale-up rules when the spec gives none (docs/operator.md, Autoscaling, argues the
# numbers). A new engine serves only once its model is loaded, minutes after the HPA asked for
# it; meanwhile a metric compared as a whole (the fullest pod's KV usage, a latency quantile)
# has not moved, and each pod that turns Ready multiplies it in again. At most doubling within
# a period about an engine's start-up means no more pods load than serve: the next step is
# taken on what the last one did. Kubernetes' own default (4 pods or 100% per 15 s) reaches
# maxReplicas long before the first new pod serves. The window keeps a burst shorter than a
# minute, which the engines' queues absorb, from starting a pod that loads for minutes and is
# scaled in again 5 minutes later.
DEFAULT_SCALE_UP: Object = {
    "stabilizationWindowSeconds": 60,
    "selectPolicy": "Max",
    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 180}],
}


def behavior(spec: AutoscalingSpec) -> Object:
    """The HPA behavior of every autoscaled role: the spec's fields over DEFAULT_SCALE_UP;
    scaleDown as given (Kubernetes' defaults where unset)."""
    given = (
        {} if spec.behavior is None else spec.behavior.model_dump(by_alias=True, exclude_none=True)
    )
    rendered: Object = {"scaleUp": {**copy.deepcopy(DEFAULT_SCALE_UP), **given.get("scaleUp", {})}}
    if "scaleDown" in given:
        rendered["scaleDown"] = given["scaleDown"]
    return rendered


def hpa_quantity(target: float) -> str:
    """A target as a Kubernetes quantity: whole numbers plain, fractions in milli-units."""
    if float(target).is_integer():
        return str(int(target))
    return f"{round(target * 1000)}m"


def keda_threshold(target: float) -> str:
    """A target as a KEDA threshold: the spec's value to its last digit, without an exponent
    (`:g` keeps 6 significant digits: 1234567 would scale at 1.23457e+06)."""
    return format(Decimal(repr(target)).normalize(), "f")


def hpa_metric(isvc: InferenceService, role: EngineRole, scaling: RoleAutoscaling) -> Object:
    if scaling.metric in MAX_OVER_PODS:
        selector = {"matchLabels": {INSTANCE_PROMETHEUS_LABEL: isvc.metadata.name, "role": role}}
        return {
            "type": "External",
            "external": {
                "metric": {"name": MAX_OVER_PODS[scaling.metric], "selector": selector},
                "target": {"type": "Value", "value": hpa_quantity(scaling.target)},
            },
        }
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": HPA_METRICS[scaling.metric]},
            "target": {"type": "AverageValue", "averageValue": hpa_quantity(scaling.target)},
        },
    }


def horizontal_pod_autoscaler(
    isvc: InferenceService, role: EngineRole, scaling: RoleAutoscaling, spec: AutoscalingSpec
) -> Object:
    name = naming.role_object_name(isvc.metadata.name, role)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(isvc, name, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [hpa_metric(isvc, role, scaling)],
            "behavior": behavior(spec),
        },
    }


def prometheus_query(namespace: str, deployment: str, role: EngineRole, metric: str) -> str:
    """PromQL for one role's pods."""
    pods = f'namespace="{namespace}",pod=~"{naming.pod_name_pattern(deployment)}",role="{role}"'
    if metric == "timeToFirstToken":
        # no first token in the window: the quantile is NaN, which KEDA would take as a value;
        # no traffic is no latency (`>= 0` drops the NaN, `or` puts 0 in its place)
        return (
            "(histogram_quantile(0.9, sum by (le) "
            f"(rate(kubesgl_time_to_first_token_seconds_bucket{{{pods}}}[2m]))) >= 0) or vector(0)"
        )
    if metric in MAX_OVER_PODS:
        return f"max({HPA_METRICS[metric]}{{{pods}}})"
    return f"sum({HPA_METRICS[metric]}{{{pods}}})"


def scaled_object(
    isvc: InferenceService, role: EngineRole, scaling: RoleAutoscaling, spec: AutoscalingSpec
) -> Object:
    name = naming.role_object_name(isvc.metadata.name, role)
    assert spec.prometheus_address is not None  # validation requires it for KEDA
    # Sums are divided by the replica count (AverageValue); a latency quantile is not additive
    # and the fullest pod's KV usage is no sum, so those are compared as a whole (Value).
    whole = scaling.metric == "timeToFirstToken" or scaling.metric in MAX_OVER_PODS
    metric_type = "Value" if whole else "AverageValue"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(isvc, name, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            # the HPA KEDA makes for the ScaledObject takes it as it is
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(spec)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": metric_type,
                    "metadata": {
                        "serverAddress": spec.prometheus_address,
                        "query": prometheus_query(
                            isvc.metadata.namespace, name, role, scaling.metric
                        ),
                        "threshold": keda_threshold(scaling.target),
                    },
                }
            ],
        },
    }


def autoscaler(isvc: InferenceService, role: EngineRole) -> Object | None:
    spec = isvc.spec.autoscaling
    scaling = isvc.spec.autoscaling_for(role)
    if spec is None or scaling is None:
        return None
    if spec.provider == "keda":
        return scaled_object(isvc, role, scaling, spec)
    return horizontal_pod_autoscaler(isvc, role, scaling, spec)
