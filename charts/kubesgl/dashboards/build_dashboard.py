"""Writes kubesgl.json, the Grafana dashboard the chart ships (a ConfigMap that Grafana's
dashboard sidecar picks up). The JSON is generated so that every query is written once;
tests/unit/test_dashboard.py checks that the committed file is this script's output, that
every query parses as PromQL, and that every metric it reads is one kubesgl exports.

    python charts/kubesgl/dashboards/build_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

SELECTOR = 'namespace=~"$namespace", app_kubernetes_io_instance=~"$instance"'
RATE = "$__rate_interval"


def rate(metric: str, by: str, extra: str = "") -> str:
    labels = SELECTOR + (f", {extra}" if extra else "")
    return f"sum by ({by}) (rate({metric}{{{labels}}}[{RATE}]))"


def quantile(q: float, histogram: str, by: str) -> str:
    """`>= 0` drops the NaN of an interval with no observation (KV transfer time while nothing
    transfers): no point rather than NaN."""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{{{SELECTOR}}}[{RATE}]))) >= 0"


def gauge(metric: str, how: str, by: str) -> str:
    return f"{how} by ({by}) ({metric}{{{SELECTOR}}})"


def peak(metric: str, how: str, by: str) -> str:
    """The highest sample of each series over the interval: a burst between two of Grafana's
    points (which read one sample each) still shows."""
    return f"{how} by ({by}) (max_over_time({metric}{{{SELECTOR}}}[{RATE}]))"


def ratio(numerator: str, denominator: str, by: str) -> str:
    """A ratio of two counters' rates; `>= 0` drops the NaN of an idle interval (0/0)."""
    return f"({rate(numerator, by)} / {rate(denominator, by)}) >= 0"


def latency(histogram: str, by: str) -> list[tuple[str, str]]:
    return [(quantile(0.5, histogram, by), f"p50 {{{{{by}}}}}"), (quantile(0.99, histogram, by), f"p99 {{{{{by}}}}}")]


# (title, unit, [(query, legend)]), laid out two to a row
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Finished requests by reason", "reqps", [(rate("kubesgl_requests_total", "finish_reason"), "{{finish_reason}}")]),
    ("Engine errors by reason", "reqps", [(rate("kubesgl_request_errors_total", "role, status, reason"),
                                           "{{role}} {{status}} {{reason}}")]),
    ("Tokens per second", "short", [(rate("kubesgl_prompt_tokens_total", "role"), "prompt {{role}}"),
                                    (rate("kubesgl_generation_tokens_total", "role"), "generated {{role}}")]),
    ("Time to first token", "s", latency("kubesgl_time_to_first_token_seconds", "role")),
    ("Inter-token latency", "s", latency("kubesgl_inter_token_latency_seconds", "role")),
    ("End-to-end request latency", "s", latency("kubesgl_e2e_request_latency_seconds", "role")),
    ("Running and waiting requests (peaks: the busiest pod's highest sample in the interval)", "short", [
        (gauge("kubesgl_num_running_requests", "sum", "role"), "running {{role}}"),
        (gauge("kubesgl_num_waiting_requests", "sum", "role"), "waiting {{role}}"),
        (peak("kubesgl_num_running_requests", "max", "role"), "peak running on one pod {{role}}"),
        (peak("kubesgl_num_waiting_requests", "max", "role"), "peak waiting on one pod {{role}}")]),
    ("KV cache usage (committed / pool), peak per pod", "percentunit", [
        (peak("kubesgl_kv_cache_usage_ratio", "max", "pod, role"), "{{pod}}")]),
    ("Retractions (running requests re-queued to free KV pages)", "ops", [
        (rate("kubesgl_retractions_total", "role"), "{{role}}")]),
    ("Queue, prefill and decode time", "s", [
        (quantile(0.5, "kubesgl_request_queue_time_seconds", "role"), "queue p50 {{role}}"),
        (quantile(0.99, "kubesgl_request_queue_time_seconds", "role"), "queue p99 {{role}}"),
        (quantile(0.99, "kubesgl_request_prefill_time_seconds", "role"), "prefill p99 {{role}}"),
        (quantile(0.99, "kubesgl_request_decode_time_seconds", "role"), "decode p99 {{role}}")]),
    ("Prefix cache hit ratio (cached over prompt tokens)", "percentunit", [
        (ratio("kubesgl_cached_prompt_tokens_total", "kubesgl_prompt_tokens_total", "role"), "{{role}}")]),
    ("KV transfer (prefill to decode)", "Bps", [(rate("kubesgl_kv_transfer_bytes_total", "role"), "{{role}}")]),
    ("KV transfer time", "s", latency("kubesgl_kv_transfer_seconds", "role")),
    ("P/D: requests with a room, by state", "short", [
        (gauge("kubesgl_disagg_requests", "sum", "role, state"), "{{role}} {{state}}")]),
    ("P/D: failed rooms by reason", "ops", [(rate("kubesgl_disagg_failures_total", "role, reason"),
                                             "{{role}} {{reason}}")]),
    ("P/D: wait for the other engine (decode: for the KV; prefill: for the slots)", "s",
     latency("kubesgl_kv_transfer_wait_seconds", "role")),
    ("Router: P/D routes", "reqps", [(rate("kubesgl_router_pd_routes_total", "route"), "{{route}}")]),
    ("Router answers by status: attempts on workers, and the router's own rejections", "reqps", [
        (rate("kubesgl_router_requests_total", "status", 'worker!=""'), "{{status}} from a worker"),
        (rate("kubesgl_router_rejections_total", "status, reason"), "{{status}} {{reason}} (router)")]),
    ("Router request duration", "s", latency("kubesgl_router_request_duration_seconds", "pod")),
    ("Router: healthy workers", "short", [(gauge("kubesgl_router_worker_healthy", "max", "worker"), "{{worker}}")]),
    ("Router: in-flight requests per worker (summed over router replicas)", "short", [
        (gauge("kubesgl_router_worker_load", "sum", "worker"), "{{worker}}")]),
    ("Router: cache-aware decisions", "ops", [(rate("kubesgl_router_cache_decisions_total", "decision"), "{{decision}}")]),
    ("Router: retries", "ops", [(rate("kubesgl_router_retries_total", "pod"), "{{pod}}")]),
    ("Scrape health (1: Prometheus reached the pod's /metrics)", "short", [
        (gauge("up", "min", "pod"), "{{pod}}")]),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def label_variable(name: str, query: str) -> dict:
    return {"name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "includeAll": True, "multi": True,
            "current": {"text": "All", "value": "$__all"}, "refresh": 2}


def dashboard() -> dict:
    return {
        "uid": "kubesgl", "title": "kubesgl", "tags": ["kubesgl", "llm"], "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            label_variable("namespace", "label_values(kubesgl_num_running_requests, namespace)"),
            label_variable("instance", 'label_values(kubesgl_num_running_requests{namespace=~"$namespace"}, '
                                       "app_kubernetes_io_instance)"),
        ]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    (Path(__file__).parent / "kubesgl.json").write_text(render())
