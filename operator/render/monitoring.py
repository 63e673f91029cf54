"""A prometheus-operator PodMonitor that scrapes every pod of the instance (engines and router)."""

from __future__ import annotations

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.render.common import Object, metadata
from kubesgl.operator.spec import InferenceService


def pod_monitor(isvc: InferenceService) -> Object | None:
    settings = isvc.spec.monitoring.pod_monitor
    if settings is None:
        return None
    meta = metadata(isvc, isvc.metadata.name)
    # Extra labels let a Prometheus whose podMonitorSelector wants e.g. release=prometheus see it.
    meta["labels"] = {**settings.labels, **meta["labels"]}
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
