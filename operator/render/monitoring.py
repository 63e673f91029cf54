"""A prometheus-operator PodMonitor that scrapes every pod of the instance (engines and router)."""

from __future__ import annotations

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.render.common import Object, labels, metadata
from kubesgl.operator.spec import InferenceService


def pod_monitor(isvc: InferenceService) -> Object | None:
    settings = isvc.spec.monitoring.pod_monitor
    if settings is None:
        return None
    meta = metadata(isvc, isvc.metadata.name)
    # Its own labels let a Prometheus whose podMonitorSelector wants e.g. release=prometheus see
    # it: over the InferenceService's, which may hold another `release` (Helm's).
    meta["labels"] = labels(isvc, extra=settings.labels)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(isvc.metadata.name)},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": settings.interval}
            ],
            "podTargetLabels": [contract.INSTANCE_LABEL, contract.ROLE_LABEL],
        },
    }
