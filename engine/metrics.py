"""The engine's Prometheus metrics (docs/server.md, metrics), all labelled with the role, and
at /metrics with the served model's name (model_name, as vLLM labels them).

Latencies are measured in the API server, where requests arrive and tokens leave; the
scheduler's state (running, waiting, KV usage, prefix hits) arrives with each step's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kubesgl.contract import (
    LATENCY_BUCKETS_S,
    MIXED,
    PARTNER_FAILED_STATUS,
    PARTNER_TIMEOUT_STATUS,
    PREFILL,
    REQUEST_BUCKETS_S,
)
from kubesgl.engine.disagg.protocol import FailureReason
from kubesgl.engine.messages import DisaggStats, FinishKind, GrammarStats, SchedulerStats

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)  # a metric and its series are of one class

# No `_created` series beside each counter and histogram (prometheus_client's default): Prometheus
# finds resets itself, and they would double the series each engine and router is scraped for.
disable_created_metrics()

# States of a request with a room that the kubesgl_disagg_requests gauge reports
# (the scheduler's ReqStatus names, lower case).
DISAGG_STATES = ("waiting", "prefilling", "transferring", "awaiting_kv", "decoding", "finished")

# finish_reason values of kubesgl_requests_total ("error" is counted by kubesgl_request_errors_total).
FINISH_REASONS = tuple(kind for kind in get_args(FinishKind) if kind != "error")
# ... and on a prefill engine, a room's request whose KV reached the decode engine: handed
# off, not finished (its answer's finish_reason says "length"; the decode engine counts its end)
HANDOFF = "handoff"
# kubesgl_request_errors_total: error answers by status, the reason label naming each.
ERROR_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    500: "internal",
    503: "unavailable",
}
# ... and the statuses only prefill and decode engines answer, under the reasons any other
# status gets (`error_reason`): a bootstrap room already in use or closed (409), the other
# engine failed (502) or did not act in time (504)
PD_ERROR_STATUSES = (409, PARTNER_FAILED_STATUS, PARTNER_TIMEOUT_STATUS)


def error_reason(status: int) -> str:
    return ERROR_REASONS.get(status, "client_error" if status < 500 else "server_error")


# Prompt and output lengths in tokens: 1 to 128k, powers of two. A quantile that falls in the
# first bucket, (0, 1], reads between 0 and 1 (histogram_quantile interpolates inside it).
_LENGTH_BUCKETS = tuple(2**i for i in range(18))
# Grammar compilations: a regex in well under a millisecond, a large JSON schema over a 128k vocabulary in seconds
_COMPILE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# kubesgl_grammar_cache_total: whether a request's grammar was already compiled (or compiling)
GRAMMAR_CACHE_RESULTS = ("hit", "miss")

# Token gaps: close where a GPU's decode steps fall (5 to 50 ms), then up to a step that waits
# behind a long prefill. Every edge of earlier versions is kept.
_ITL_BUCKETS = (
    0.001, 0.002, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# One request's KV moving between engines: a short prompt's over NVLink or RDMA takes well
# under a millisecond (a 4096-token prompt of an 8B model about 2 ms on an H200).
_KV_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.0015, 0.002, *LATENCY_BUCKETS_S)


class _WithLabel(Collector):
    """Every sample of a registry with one more label, added at scrape time: prometheus_client
    has no constant labels, and a label that each metric declared itself could be forgotten."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str) -> None:
        self._registry, self._name, self._value = registry, name, value

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():  # fresh objects on each collect: ours to change
            family.samples = [
                s._replace(labels={**s.labels, self._name: self._value}) for s in family.samples
            ]
            yield family


class EngineMetrics:
    """The metrics of an engine of one role. Each metric labelled by the role alone is bound to
    its one series when made, so that series exists at zero before its first count; those with
    more labels are reached through `_series`, and their known label values made at zero too."""

    def __init__(self, role: str, model_name: str = ""):
        self.role = role
        self.registry = CollectorRegistry()  # the metrics as recorded, by role
        self._exported = CollectorRegistry(auto_describe=False)  # ... and at /metrics, by model too
        self._exported.register(_WithLabel(self.registry, "model_name", model_name))
        r, labels = self.registry, ["role"]
        self.num_running = Gauge(
            "kubesgl_num_running_requests", "Requests admitted and not finished", labels, registry=r
        ).labels(role=role)
        self.num_waiting = Gauge(
            "kubesgl_num_waiting_requests",
            "Requests queued for admission (those whose grammar still compiles included)",
            labels,
            registry=r,
        ).labels(role=role)
        self.kv_usage = Gauge(
            "kubesgl_kv_cache_usage_ratio",
            "Share of the KV pool committed: pages held by requests or locked in the prefix "
            "cache, plus pages reserved for running requests' remaining outputs (evictable "
            "cache excluded); what admission is bound by",
            labels,
            registry=r,
        ).labels(role=role)
        self.prefix_hit = Gauge(
            "kubesgl_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache, over all prompt tokens since start or "
            "the last cache flush, of the prompts this engine prefilled (a decode engine: only "
            "requests without a bootstrap room)",
            labels,
            registry=r,
        ).labels(role=role)
        self.prompt_tokens = Counter(
            "kubesgl_prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        ).labels(role=role)
        self.generation_tokens = Counter(
            "kubesgl_generation_tokens",
            "Generated tokens (a P/D room's first: on the decode engine, whose answer holds it)",
            labels,
            registry=r,
        ).labels(role=role)
        self.requests = Counter(
            "kubesgl_requests",
            "Finished requests, by finish_reason (prefill engines also: handoff, a room's request "
            "whose KV reached the decode engine, which counts its end)",
            labels + ["finish_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "kubesgl_request_errors",
            "Requests answered with an error (HTTP status >= 400, or an error "
            "event ending a stream), by status; a client that leaves is an abort, not an error",
            labels + ["status", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "kubesgl_time_to_first_token_seconds",
            "Time to first token (a prefill engine's room: to its first token computed, before "
            "the wait for the decode engine and the KV write)",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.itl = Histogram(
            "kubesgl_inter_token_latency_seconds",
            "Time between tokens",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(role=role)
        self.e2e = Histogram(
            "kubesgl_e2e_request_latency_seconds",
            "Request latency, arrival to last token (a prefill engine's room: to its answer, "
            "after its KV reached the decode engine)",
            labels,
            buckets=REQUEST_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.queue_time = Histogram(
            "kubesgl_request_queue_time_seconds",
            "Time a request waited in the scheduler's queue before admission",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.prefill_time = Histogram(
            "kubesgl_request_prefill_time_seconds",
            "From admission to the first token computed (a decode engine's room: to the KV's "
            "arrival; a prefill engine's: not to its KV's handoff)",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.decode_time = Histogram(
            "kubesgl_request_decode_time_seconds",
            "From the first output token to the last",
            labels,
            buckets=REQUEST_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.prompt_length = Histogram(
            "kubesgl_request_prompt_tokens",
            "Prompt length of finished requests, in tokens",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(role=role)
        self.output_length = Histogram(
            "kubesgl_request_generation_tokens",
            "Tokens generated per finished request",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(role=role)
        self.cached_tokens = Counter(
            "kubesgl_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the prefix cache, as their answers' "
            "usage says (a decode engine's room: the prefill engine's count); hit ratio: its "
            "rate over kubesgl_prompt_tokens_total's",
            labels,
            registry=r,
        ).labels(role=role)
        self.retractions = Counter(
            "kubesgl_retractions",
            "Running requests sent back to the queue to free KV "
            "pages (they resume later where they stopped)",
            labels,
            registry=r,
        ).labels(role=role)
        self.kv_capacity = Gauge(
            "kubesgl_kv_cache_capacity_tokens", "Tokens the KV pool holds", labels, registry=r
        ).labels(role=role)
        self.build_info = Info(
            "kubesgl_build", "The kubesgl version and the model served", labels, registry=r
        )
        self.kv_transfer_bytes = Counter(
            "kubesgl_kv_transfer_bytes",
            "KV bytes moved between prefill and decode",
            labels,
            registry=r,
        ).labels(role=role)
        self.kv_transfer_seconds = Histogram(
            "kubesgl_kv_transfer_seconds",
            "Time to move one request's KV",
            labels,
            buckets=tuple(sorted(_KV_TRANSFER_BUCKETS)),
            registry=r,
        ).labels(role=role)
        self.kv_transfer_wait = Histogram(
            "kubesgl_kv_transfer_wait_seconds",
            "Time a room waited for the other "
            "engine: decode, from admission to the KV's arrival; prefill, from the "
            "request's arrival to the decode side's slots",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        ).labels(role=role)
        self.disagg_requests = Gauge(
            "kubesgl_disagg_requests",
            "Requests with a bootstrap room, by state",
            labels + ["state"],
            registry=r,
        )
        self.disagg_failures = Counter(
            "kubesgl_disagg_failures",
            "Rooms that failed, by reason",
            labels + ["reason"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "kubesgl_grammar_compile_seconds",
            "Time to compile one grammar (response_format, regex, json_schema, ebnf)",
            labels,
            buckets=_COMPILE_BUCKETS,
            registry=r,
        ).labels(role=role)
        self.grammar_cache = Counter(
            "kubesgl_grammar_cache",
            "Requests with a grammar, by whether it was already compiled",
            labels + ["result"],
            registry=r,
        )
        self._create_known_series()
        self._failures_seen: dict[str, int] = {}
        self._retractions_seen = 0
        self._grammar_cache_seen = {"hit": 0, "miss": 0}

    def _series(self, metric: _Metric, **labels: str) -> _Metric:
        """`metric`'s series for this engine's role and `labels` (made on first use)."""
        return metric.labels(role=self.role, **labels)

    def _create_known_series(self) -> None:
        """Every known label value from the start, at zero: a series that appears already holding
        its first count is invisible to rate() and increase()."""
        for finish_reason in FINISH_REASONS + ((HANDOFF,) if self.role == PREFILL else ()):
            self._series(self.requests, finish_reason=finish_reason)
        for result in GRAMMAR_CACHE_RESULTS:
            self._series(self.grammar_cache, result=result)
        for status, reason in ERROR_REASONS.items():
            self._series(self.request_errors, status=str(status), reason=reason)
        if self.role != MIXED:  # P/D rooms only exist on prefill and decode engines
            for state in DISAGG_STATES:
                self._series(self.disagg_requests, state=state)
            for failure in FailureReason:
                self._series(self.disagg_failures, reason=failure.value)
            for status in PD_ERROR_STATUSES:
                self._series(self.request_errors, status=str(status), reason=error_reason(status))

    def render(self) -> bytes:
        """The /metrics text: every sample carries model_name beside its own labels."""
        return generate_latest(self._exported)

    def update_scheduler(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_used_tokens / max(stats.kv_total_tokens, 1))
        self.kv_capacity.set(stats.kv_total_tokens)
        self.prefix_hit.set(stats.cached_prompt_tokens / max(stats.prompt_tokens, 1))
        self.retractions.inc(max(0, stats.retractions - self._retractions_seen))
        self._retractions_seen = stats.retractions
        if stats.disagg is not None:
            self._update_disagg(stats.disagg)
        if stats.grammar is not None:
            self._update_grammar(stats.grammar)

    def _update_grammar(self, grammar: GrammarStats) -> None:
        for result, total in (("hit", grammar.cache_hits), ("miss", grammar.cache_misses)):
            self._series(self.grammar_cache, result=result).inc(
                max(0, total - self._grammar_cache_seen[result])
            )
            self._grammar_cache_seen[result] = total
        for seconds in grammar.compile_seconds:
            self.grammar_compile.observe(seconds)

    def _update_disagg(self, disagg: DisaggStats) -> None:
        for state in DISAGG_STATES:
            self._series(self.disagg_requests, state=state).set(
                disagg.requests_by_state.get(state, 0)
            )
        for reason, total in disagg.failures_by_reason.items():
            self._series(self.disagg_failures, reason=reason).inc(
                total - self._failures_seen.get(reason, 0)
            )
            self._failures_seen[reason] = total
        for nbytes, seconds in disagg.transfers:
            self.kv_transfer_bytes.inc(nbytes)
            self.kv_transfer_seconds.observe(seconds)
        for seconds in disagg.kv_waits:
            self.kv_transfer_wait.observe(seconds)

    def tokens(self, count: int, since_last: float, first: bool) -> None:
        """`count` new tokens, `since_last` seconds after the previous ones (or the arrival).

        The first output's time is the TTFT; tokens that arrive with the first one (a P/D
        handoff, an output that several steps filled) came at no measured interval and are no
        inter-token latency. A later output of n tokens counts n intervals of since_last / n
        (SGLang's convention), so the ITL histogram counts every token after the first output."""
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(since_last)
            return
        for _ in range(count):
            self.itl.observe(since_last / count)

    def handed_off(self, seconds_to_first_token: float) -> None:
        """A prefill engine's answer to a room: its TTFT, to the token computed. The token is
        the decode engine's first, which counts it as generated (it is in that engine's
        answer and usage), so summed over a P/D instance each token counts once."""
        self.ttft.observe(seconds_to_first_token)

    def request_error(self, status: int) -> None:
        self._series(self.request_errors, status=str(status), reason=error_reason(status)).inc()

    def set_build_info(self, version: str, model: str) -> None:
        # made here, not at construction: an info series before it is set would be one without
        # version and model
        self._series(self.build_info).info({"version": version, "model": model})

    def scheduled(self, queue_seconds: float, prefill_seconds: float) -> None:
        """A request's times in the scheduler, which come with its first output."""
        self.queue_time.observe(queue_seconds)
        self.prefill_time.observe(prefill_seconds)

    def finished(
        self,
        seconds: float,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        decode_seconds: float | None = None,
    ) -> None:
        self.e2e.observe(seconds)
        self._series(self.requests, finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        if prompt_tokens:  # an abort before tokenization knows none
            self.prompt_length.observe(prompt_tokens)
        if finish_reason != HANDOFF:  # its output's length is the decode engine's to count
            self.output_length.observe(output_tokens)
        if decode_seconds is not None:
            self.decode_time.observe(decode_seconds)
