"""The router's Prometheus metrics (docs/router.md), in a registry of its own.

Per-worker health and load are read from the pool at scrape time instead of being updated
on every request: nothing on the hot path, and removed workers vanish from the output. Their
attempt counters go with them: a pool that discovery keeps changing leaves no stale series.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kubesgl.contract import REQUEST_BUCKETS_S
from kubesgl.router.workers import Worker, WorkerRegistry

# No `_created` series beside each counter and histogram (prometheus_client's default): Prometheus
# finds resets itself, and they would double the series each engine and router is scraped for.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PDRoute(StrEnum):
    """Where a request of a prefill/decode pool went (kubesgl_router_pd_routes' route label)."""

    DISAGGREGATED = "disaggregated"  # to a prefill and a decode worker
    # To a decode worker alone, which prefills the prompt itself, because
    DECODE_ONLY_SHORT = "decode_only_short"  # what the decode worker has not cached is short
    DECODE_ONLY_SATURATED = "decode_only_saturated"  # every prefill worker is saturated
    DECODE_ONLY_NO_PREFILL = "decode_only_no_prefill"  # no prefill worker can serve it
    # prefill workers can, none with the decode worker's KV layout (router/kv_layouts.py)
    DECODE_ONLY_INCOMPATIBLE = "decode_only_incompatible"


CACHE_DECISIONS = ("hit", "miss", "balance")
# The outcomes of kubesgl_router_requests_total that every worker's series start with, at
# zero once the worker is known: rate() then sees the first success, failure or abort.
WORKER_STATUSES = ("200", "error", "cancelled")
# Answers the router gives itself, without a worker, by status: the reason label names them.
REJECTION_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",  # DELETE /workers of a worker discovery follows
    413: "too_large",
    500: "internal",
    503: "no_worker",
}
NO_WORKER = REJECTION_REASONS[503]
# Rejections whose reason is not their status's: no free connection slot (--max-connections)
CONNECTION_LIMIT = "connection_limit"
OTHER_REJECTIONS = ((503, CONNECTION_LIMIT),)
# The statuses of kubesgl_router_responses_total at zero from the start, the answers clients
# commonly get: a success, their own errors (a bad request, a wrong key, a model not served,
# too many requests), the workers' and the router's failures. Others appear at their first.
RESPONSE_STATUSES = ("200", "400", "401", "404", "429", "500", "502", "503", "504")
# Why a stream that had started ended with the router's SSE error event: its worker broke it
# off (the connection broke or went silent), or the router's shutdown timeout cut it.
BROKEN_STREAM_REASONS = ("worker", "shutdown")


class _WorkerCollector(Collector):
    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "kubesgl_router_worker_healthy",
            "1 when the worker passes health checks and its circuit breaker is not open",
            labels=["worker"],
        )
        load = GaugeMetricFamily(
            "kubesgl_router_worker_load",
            "Requests the router has in flight on the worker",
            labels=["worker"],
        )
        info = GaugeMetricFamily(
            "kubesgl_router_worker_info",
            "1 per worker: its role, when discovery found it its pod's name (worker_pod), to join the "
            "worker label to the engines' own series (on (worker) group_left (worker_pod)), and the "
            "model it serves (model_name, from its /v1/models; empty until it answered)",
            labels=["worker", "role", "worker_pod", "model_name"],
        )
        for worker in self._workers.all():
            healthy.add_metric([worker.url], 1.0 if worker.can_serve() else 0.0)
            load.add_metric([worker.url], float(worker.in_flight))
            info.add_metric([worker.url, worker.role.value, worker.pod, worker.model_name], 1.0)
        yield healthy
        yield load
        yield info


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kubesgl_router_requests",
            "Upstream attempts by worker and outcome: the HTTP status, `error` when the "
            "connection failed, timed out or broke mid-stream (or a P/D prefill request had not "
            "answered when its decode worker failed for it), or `cancelled` when the client left "
            "or the other side of a P/D pair failed or refused the request (its own 502 or 504, "
            "or a prefill's 409, then only passed that on; worker is empty when none could serve)",
            ["worker", "status"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "kubesgl_router_request_duration_seconds",
            "Generation requests whose body the router read, whatever their answer: time from "
            "receiving the request to sending the last byte of its answer",
            buckets=REQUEST_BUCKETS_S,  # as the engines': a long streamed answer too
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "kubesgl_router_time_to_first_byte_seconds",
            "Generation requests answered 200: time from receiving the request to sending the first "
            "byte of the answer (for a stream, about the time to first token)",
            buckets=REQUEST_BUCKETS_S,  # it may wait in an engine's queue
            registry=self.registry,
        )
        self.cache_decisions = Counter(
            "kubesgl_router_cache_decisions",
            "Decisions of the cache-aware policy",
            ["decision"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "kubesgl_router_rejections",
            "Requests the router answered itself with an error, sent to no worker: bad requests, "
            "wrong keys, unknown paths, bodies over the limit, no worker that can serve (that one "
            'is also kubesgl_router_requests_total{worker="",status="503"}), internal errors',
            ["status", "reason"],
            registry=self.registry,
        )
        self.responses = Counter(
            "kubesgl_router_responses",
            "Answers sent to clients by HTTP status, once per request as its answer starts: "
            "a worker's (after any retries: the last try's), or the router's own (each of "
            "kubesgl_router_rejections_total); none for /health, /liveness, /metrics and "
            "/workers unless rejected. A stream counts by the status it started with, "
            "also one broken later (kubesgl_router_broken_streams_total)",
            ["status"],
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "kubesgl_router_broken_streams",
            "Streamed answers that had started and that the router ended with an SSE error "
            "event and [DONE]: their worker broke off (`worker`: the connection broke or sent "
            "nothing within the read timeout), or the router's shutdown timeout cut them "
            "(`shutdown`); an engine's own error event, passed on, is not counted here",
            ["reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kubesgl_router_retries",
            "Requests sent again to another worker after a failure before any byte reached the client",
            registry=self.registry,
        )
        self.pd_routes = Counter(
            "kubesgl_router_pd_routes",
            "P/D mode: requests sent to a prefill and a decode worker (disaggregated), or to a "
            "decode worker alone (short uncached prompt, a saturated prefill pool, or no prefill "
            "worker that can serve); once per request, by the attempt that served it, and none "
            "for a request the engines refused",
            ["route"],
            registry=self.registry,
        )
        # Known label values present from the start, at zero: rate() sees the first increment
        for route in PDRoute:
            self.pd_routes.labels(route)
        for decision in CACHE_DECISIONS:
            self.cache_decisions.labels(decision)
        self.requests.labels("", "503")  # no worker could serve
        for answer in RESPONSE_STATUSES:
            self.responses.labels(answer)
        for reason in BROKEN_STREAM_REASONS:
            self.broken_streams.labels(reason)
        for status, reason in (*REJECTION_REASONS.items(), *OTHER_REJECTIONS):
            self.rejections.labels(str(status), reason)
        # Each worker in the pool, by URL, with the statuses its kubesgl_router_requests_total
        # series hold: the worker itself, as another may come back at its URL.
        self._worker_statuses: dict[str, tuple[Worker, set[str]]] = {}
        for worker in workers.all():
            self._worker_added(worker)
        workers.on_added(self._worker_added)
        workers.on_removed(self._worker_removed)
        self.registry.register(_WorkerCollector(workers))

    def _worker_added(self, worker: Worker) -> None:
        self._worker_statuses[worker.url] = (worker, set(WORKER_STATUSES))
        for status in WORKER_STATUSES:
            self.requests.labels(worker.url, status)

    def _worker_removed(self, worker: Worker) -> None:
        _, statuses = self._worker_statuses.pop(worker.url, (worker, set()))
        for status in statuses:
            self.requests.remove(worker.url, status)

    def attempt_finished(self, worker: Worker, status: str) -> None:
        """Counts an attempt's outcome, unless its worker left the pool while it ran: that would
        bring the removed worker's series back, never to go again, or count it into another
        worker that came back at its URL since (a pod ready again)."""
        current = self._worker_statuses.get(worker.url)
        if current is None or current[0] is not worker:
            return
        current[1].add(status)
        self.requests.labels(worker.url, status).inc()

    def rejected(self, status: int, reason: str | None = None) -> None:
        reason = reason or REJECTION_REASONS.get(status, "other")
        self.rejections.labels(str(status), reason).inc()
        if reason == NO_WORKER:  # counted here alone: once per answer, on every path to one
            self.requests.labels("", "503").inc()

    def answered(self, status: int) -> None:
        self.responses.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
