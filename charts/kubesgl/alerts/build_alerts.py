"""Writes kubesgl.rules.yaml, the Prometheus alerting rules the chart ships as a
PrometheusRule (templates/prometheusrule.yaml, `alerts.enabled`). The file is a plain
Prometheus rules file (`groups:`, what a PrometheusRule's spec holds), so `promtool check
rules` and `promtool test rules` read it as it is. Every expression is written once here;
tests/unit/test_alerts.py checks that the committed file is this script's output, that every
expression parses as PromQL, that every metric it reads is one kubesgl exports, and (with
promtool) that the alerts fire on synthetic series when they should and stay silent when they
should not.

Alerts cannot use the dashboard's Grafana variables: they group by the labels that the
PodMonitor the operator renders (spec.monitoring.podMonitor) puts on every series, `namespace`
and `app_kubernetes_io_instance` (the InferenceService), plus `pod` and the engines' own
`role` where an alert is about one pod. `kubesgl_io_role` (the pods' kubesgl.io/role label,
also a podTargetLabel) tells kubesgl's pods from others for `up`, which has no kubesgl name.

    python charts/kubesgl/alerts/build_alerts.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

SERVICE = "namespace, app_kubernetes_io_instance"
# An engine pod: the engine's own role label and its model, beside the InferenceService's
ENGINE_POD = f"{SERVICE}, role, model_name, pod"
# Router series of one router pod and worker: what joins worker_healthy and requests_total to
# kubesgl_router_worker_info (each router replica exports its own)
ROUTER_WORKER = f"{SERVICE}, pod, worker"
KUBESGL_PODS = 'kubesgl_io_role=~"mixed|prefill|decode|router"'
WINDOW = "5m"
DOCS = "docs/operator.md#alerts"
WHO = "{{ $labels.namespace }}/{{ $labels.app_kubernetes_io_instance }}"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    duration: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.duration,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": f"{self.description} See {DOCS} ({self.name}).",
            },
        }


def no_healthy_worker() -> Alert:
    # A router whose pool is empty (discovery found no ready engine pod) exports no
    # worker_healthy at all: its requests_total{worker=""} series, there from its start, says
    # that a router of the InferenceService is scraped.
    unhealthy = f"max by ({SERVICE}) (kubesgl_router_worker_healthy) == 0"
    empty = (
        f'group by ({SERVICE}) (kubesgl_router_requests_total{{worker="", status="503"}}) '
        f"unless on ({SERVICE}) kubesgl_router_worker_healthy"
    )
    return Alert(
        "KubesglRouterNoHealthyWorker",
        f"({unhealthy}) or ({empty})",
        "2m",
        "critical",
        f"kubesgl {WHO}: the router has no healthy worker",
        f"No router replica of InferenceService {WHO} has a worker that passes its health checks "
        "with its circuit closed (or its pool is empty): every request is answered 503 no_worker. "
        "Look at the engine pods (kubectl get pods -l app.kubernetes.io/instance=NAME: not ready, "
        "crash-looping, still loading the model), their logs, and the router's "
        "GET /workers.",
    )


def no_decode_worker() -> Alert:
    healthy_decode = (
        "kubesgl_router_worker_healthy == 1 "
        f'and on ({ROUTER_WORKER}) kubesgl_router_worker_info{{role="decode"}}'
    )
    return Alert(
        "KubesglRouterNoDecodeWorker",
        f'group by ({SERVICE}) (kubesgl_router_worker_info{{role=~"prefill|decode"}}) '
        f"unless on ({SERVICE}) ({healthy_decode})",
        "2m",
        "critical",
        f"kubesgl {WHO}: the P/D router has no healthy decode worker",
        f"InferenceService {WHO} runs prefill/decode, and no router replica has a healthy decode "
        "worker: a P/D request needs one (prefill workers alone cannot answer), so requests fail "
        "with 503. Look at the decode pods and their logs, and the router's GET /workers.",
    )


def scrape_down() -> Alert:
    return Alert(
        "KubesglScrapeDown",
        f"min by ({SERVICE}, kubesgl_io_role, pod) (up{{{KUBESGL_PODS}}}) == 0",
        "5m",
        "warning",
        f"kubesgl {WHO}: Prometheus cannot scrape {{{{ $labels.kubesgl_io_role }}}} pod "
        "{{ $labels.pod }}",
        f"Prometheus has not reached /metrics of the {{{{ $labels.kubesgl_io_role }}}} pod "
        f"{{{{ $labels.pod }}}} of InferenceService {WHO} for 5 minutes: the pod is down, "
        "restarting, hung, or the NetworkPolicy keeps Prometheus out "
        "(spec.networkPolicy.metricsFrom). Its metrics, and the other alerts about it, are blind "
        "meanwhile.",
    )


def server_errors() -> Alert:
    # What clients were answered (kubesgl_router_responses_total: once per request, after any
    # retries): a worker's 503 or failed connection that the router retried elsewhere is no
    # answer, so an InferenceService shedding load onto its other engines pages no one, while
    # one passed on after every try, as the router's own 503s (no_worker, connection_limit),
    # reached a client and counts. A stream that started 200 and broke off later (its worker's
    # connection broke, or the shutdown timeout cut it) failed its client too. Probes,
    # scrapes and admin calls are in neither.
    failed = (
        f"sum by ({SERVICE}) ("
        f'rate(kubesgl_router_responses_total{{status=~"5.."}}[{WINDOW}]) '
        f"or rate(kubesgl_router_broken_streams_total[{WINDOW}]))"
    )
    answers = f"sum by ({SERVICE}) (rate(kubesgl_router_responses_total[{WINDOW}]))"
    return Alert(
        "KubesglHighServerErrorRatio",
        f"({failed} / {answers}) > 0.05",
        "10m",
        "critical",
        f"kubesgl {WHO}: {{{{ $value | humanizePercentage }}}} of requests fail with 5xx",
        f"Over 5% of the answers that clients of InferenceService {WHO} got were server errors "
        "for 10 minutes: 5xx answers (a worker's, after the router's retries: 500, 502 when a "
        "worker's connection broke, 503 when every worker tried was busy; or the router's own: "
        "503 no_worker, no worker could serve; 503 connection_limit, --max-connections "
        "reached; 500 internal), and streams broken off after they started. Look at the "
        "dashboard's Router row (answers by status, failed attempts per worker), the router's "
        "logs and the failing workers' logs; for 503s, KubesglEngineQueueFull and the "
        "engines' refusals per pod.",
    )


def kv_cache_full() -> Alert:
    # Its average over 5 minutes (the pool fills and frees as requests come and go), with a queue
    # at some scrape of those 5 minutes (one that empties between two scrapes still saturates)
    usage = f"max by ({ENGINE_POD}) (avg_over_time(kubesgl_kv_cache_usage_ratio[{WINDOW}])) > 0.9"
    waiting = f"max by ({ENGINE_POD}) (max_over_time(kubesgl_num_waiting_requests[{WINDOW}])) > 0"
    return Alert(
        "KubesglKVCacheFull",
        f"({usage}) and on ({ENGINE_POD}) ({waiting})",
        "10m",
        "warning",
        f"kubesgl {WHO}: {{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} has its KV cache "
        "full and requests waiting",
        f"The {{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} of InferenceService {WHO} "
        "(model {{ $labels.model_name }}) kept over 90% of its KV pool committed, with requests "
        "queued, for 10 minutes: it is saturated, and queue time adds to every request's TTFT. "
        "Add replicas (or an autoscaler on kvCacheUsage or waiting requests), or give the "
        "engine more KV memory (memFractionStatic, kvCacheDtype fp8_e4m3); the dashboard's "
        "engine rows show queue time and retractions.",
    )


def engine_queue_full() -> Alert:
    # An engine's 503 is its queue full (--max-queued-requests), or a request that came while
    # it loads or drains (the metric does not tell them apart). Only a pod with requests
    # waiting at some scrape of the window counts its 503s: a full queue holds some, a loading
    # engine none. A draining one may still hold a queue, but gets requests only until the
    # router and the Service see it not ready (seconds), and a rollout's drains, one pod after
    # another, are a few seconds of each pod's share: far below 5% of the role's requests.
    queued = f"max by ({ENGINE_POD}) (max_over_time(kubesgl_num_waiting_requests[{WINDOW}])) > 0"
    refused = (
        f"sum by ({SERVICE}, role) ("
        f'rate(kubesgl_request_errors_total{{status="503"}}[{WINDOW}]) '
        f"and on ({ENGINE_POD}) ({queued}))"
    )
    # Every request the role's engines answered: finished (a prefill engine's handed off
    # included), or answered with an error of any status
    received = (
        f"(sum by ({SERVICE}, role) (rate(kubesgl_requests_total[{WINDOW}])) "
        f"+ sum by ({SERVICE}, role) (rate(kubesgl_request_errors_total[{WINDOW}])))"
    )
    return Alert(
        "KubesglEngineQueueFull",
        f"({refused} / {received}) > 0.05",
        "10m",
        "warning",
        f"kubesgl {WHO}: {{{{ $labels.role }}}} engines refuse "
        "{{ $value | humanizePercentage }} of requests, their queues full",
        f"The {{{{ $labels.role }}}} engines of InferenceService {WHO} refused over 5% of the "
        "requests sent to them with 503 for 10 minutes, with requests waiting: their queues "
        "are full (engine.maxQueuedRequests). The router sends each refused request to another "
        "engine, and its client gets the 503 (with Retry-After: 1) only when every engine "
        "tried refused it, but the role has no room left for bursts. Add replicas of the role "
        "(or an autoscaler on waiting requests or kvCacheUsage), or raise maxQueuedRequests "
        "if the engines may queue more at the cost of queue time. The dashboard's engine rows "
        "show the requests refused per pod and the waiting requests.",
    )


def kv_transfer_failures() -> Alert:
    # `aborted` is the client leaving; `refused` is mostly a request one engine takes and the
    # other does not (its own limits), answered to the client as such (docs/disaggregation.md):
    # neither is the transfer's fault.
    return Alert(
        "KubesglKVTransferFailures",
        f"sum by ({SERVICE}, role, reason) ("
        f'rate(kubesgl_disagg_failures_total{{reason=~"timeout|transfer|peer_lost"}}[{WINDOW}])'
        ") > 0",
        "15m",
        "warning",
        f"kubesgl {WHO}: P/D rooms keep failing ({{{{ $labels.reason }}}}, "
        "{{ $labels.role }} engines)",
        f"The {{{{ $labels.role }}}} engines of InferenceService {WHO} have counted rooms failed "
        "with reason {{ $labels.reason }} for 15 minutes: timeout (the other engine did not "
        "answer or the KV did not arrive in time), transfer (the KV write failed: the NIXL/UCX "
        "transport), peer_lost (the other engine died, restarted or could not be reached). "
        "Look at the dashboard's Prefill/decode row and both engines' logs.",
    )


def retraction_storm() -> Alert:
    retractions = f"sum by ({ENGINE_POD}) (rate(kubesgl_retractions_total[{WINDOW}]))"
    finished = f"sum by ({ENGINE_POD}) (rate(kubesgl_requests_total[{WINDOW}]))"
    return Alert(
        "KubesglRetractionStorm",
        f"({retractions} / {finished}) > 0.5",
        "15m",
        "warning",
        f"kubesgl {WHO}: {{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} keeps retracting "
        "requests",
        f"The {{{{ $labels.role }}}} engine {{{{ $labels.pod }}}} of InferenceService {WHO} sent "
        "running requests back to the queue to free KV pages at over one for every two requests "
        "it finished, for 15 minutes: its KV pool is too small for the outputs it admits, and "
        "retracted requests compute their KV again. Add replicas or KV memory "
        "(memFractionStatic, kvCacheDtype fp8_e4m3), or lower maxRunningRequests.",
    )


ALERTS = [
    no_healthy_worker(),
    no_decode_worker(),
    scrape_down(),
    server_errors(),
    kv_cache_full(),
    engine_queue_full(),
    kv_transfer_failures(),
    retraction_storm(),
]


def rules() -> dict:
    return {"groups": [{"name": "kubesgl", "rules": [alert.rule() for alert in ALERTS]}]}


def render() -> str:
    header = "# Generated by build_alerts.py: edit the script and run it, not this file.\n"
    return header + yaml.safe_dump(rules(), sort_keys=False, width=1_000_000)


if __name__ == "__main__":
    (Path(__file__).parent / "kubesgl.rules.yaml").write_text(render())
