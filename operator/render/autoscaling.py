"""Autoscalers for engine roles: an autoscaling/v2 HPA on pod metrics, or a KEDA ScaledObject
with a Prometheus trigger. Either one then owns the role's replica count."""

from __future__ import annotations

from kubesgl.contract import EngineRole
from kubesgl.operator import naming
from kubesgl.operator.render.common import Object, metadata
from kubesgl.operator.spec import AutoscalingSpec, InferenceService, RoleAutoscaling

# Engine gauges by spec metric name (docs/architecture.md, Metrics). For the HPA they are
# per-pod metrics served by a metrics adapter; timeToFirstToken needs the adapter rule in
# docs/operator.md.
HPA_METRICS = {
    "waitingRequests": "kubesgl_num_waiting_requests",
    "runningRequests": "kubesgl_num_running_requests",
    "kvCacheUsage": "kubesgl_kv_cache_usage_ratio",
    "timeToFirstToken": "kubesgl_time_to_first_token_seconds_avg",
}


def hpa_quantity(target: float) -> str:
    """A target as a Kubernetes quantity: whole numbers plain, fractions in milli-units."""
    if float(target).is_integer():
        return str(int(target))
    return f"{round(target * 1000)}m"


def horizontal_pod_autoscaler(
    isvc: InferenceService, role: EngineRole, scaling: RoleAutoscaling
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
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRICS[scaling.metric]},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": hpa_quantity(scaling.target),
                        },
                    },
                }
            ],
        },
    }


def prometheus_query(namespace: str, deployment: str, role: EngineRole, metric: str) -> str:
    """PromQL for one role's pods. Pod names are <deployment>-<replicaset hash>-<suffix>."""
    pods = f'namespace="{namespace}",pod=~"{deployment}-[a-z0-9]+-[a-z0-9]+",role="{role}"'
    if metric == "timeToFirstToken":
        return (
            "histogram_quantile(0.9, sum by (le) "
            f"(rate(kubesgl_time_to_first_token_seconds_bucket{{{pods}}}[2m])))"
        )
    return f"sum({HPA_METRICS[metric]}{{{pods}}})"


def scaled_object(
    isvc: InferenceService, role: EngineRole, scaling: RoleAutoscaling, spec: AutoscalingSpec
) -> Object:
    name = naming.role_object_name(isvc.metadata.name, role)
    assert spec.prometheus_address is not None  # validation requires it for KEDA
    # Sums are divided by the replica count (AverageValue); a latency quantile is not additive,
    # so it is compared as a whole (Value).
    metric_type = "Value" if scaling.metric == "timeToFirstToken" else "AverageValue"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(isvc, name, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": metric_type,
                    "metadata": {
                        "serverAddress": spec.prometheus_address,
                        "query": prometheus_query(
                            isvc.metadata.namespace, name, role, scaling.metric
                        ),
                        "threshold": f"{scaling.target:g}",
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
    return horizontal_pod_autoscaler(isvc, role, scaling)
