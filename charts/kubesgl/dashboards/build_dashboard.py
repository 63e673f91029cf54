"""Writes kubesgl.json, the Grafana dashboard the chart ships (a ConfigMap that Grafana's
dashboard sidecar picks up). The JSON is generated so that every query is written once;
tests/unit/test_dashboard.py checks that the committed file is this script's output, that
every query parses as PromQL, and that every metric it reads is one kubesgl exports.

A row for the router, one per engine role (the same panels, each row's queries selecting its
role: a mixed deployment leaves the prefill and decode rows empty, a P/D one the mixed row), one
for the KV transfers and rooms of prefill/decode pairs and one for scrape health.

    python charts/kubesgl/dashboards/build_dashboard.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("mixed", "prefill", "decode")
SELECTOR = 'namespace=~"$namespace", app_kubernetes_io_instance=~"$instance"'
# Engine series also carry the served model's name; the router's and `up` do not.
ENGINE_SELECTOR = SELECTOR + ', model_name=~"$model"'
RATE = "$__rate_interval"
Target = tuple[str, str]  # (query, legend)


@dataclass(frozen=True)
class Selection:
    """The series one row reads: label matchers inside {}, and the labels its lines are by."""

    matchers: str
    by: str

    def rate(self, metric: str, by: str = "", extra: str = "") -> str:
        labels = self.matchers + (f", {extra}" if extra else "")
        return f"sum by ({by or self.by}) (rate({metric}{{{labels}}}[{RATE}]))"

    def quantile(self, q: float, histogram: str) -> str:
        """`>= 0` drops the NaN of an interval with no observation (KV transfer time while
        nothing transfers): no point rather than NaN."""
        return (
            f"histogram_quantile({q}, sum by (le, {self.by}) "
            f"(rate({histogram}_bucket{{{self.matchers}}}[{RATE}]))) >= 0"
        )

    def gauge(self, metric: str, how: str, by: str = "") -> str:
        return f"{how} by ({by or self.by}) ({metric}{{{self.matchers}}})"

    def peak(self, metric: str, how: str, by: str = "") -> str:
        """The highest sample of each series over the interval: a burst between two of Grafana's
        points (which read one sample each) still shows."""
        return f"{how} by ({by or self.by}) (max_over_time({metric}{{{self.matchers}}}[{RATE}]))"

    def ratio(self, numerator: str, denominator: str) -> str:
        """A ratio of two counters' rates; `>= 0` drops the NaN of an idle interval (0/0)."""
        return f"({self.rate(numerator)} / {self.rate(denominator)}) >= 0"

    def latency(self, histogram: str, legend: str = "") -> list[Target]:
        return [
            (self.quantile(q, histogram), f"{legend}p{round(q * 100)} {{{{{self.by}}}}}")
            for q in (0.5, 0.99)
        ]


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: list[Target]


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel]


def engine_row(role: str) -> Row:
    s = Selection(f'{ENGINE_SELECTOR}, role="{role}"', "model_name")
    prefill = role == "prefill"
    panels = [
        Panel(
            "Finished requests by reason",
            "reqps",
            [(s.rate("kubesgl_requests_total", "finish_reason"), "{{finish_reason}}")],
        ),
        Panel(
            "Errors by status and reason",
            "reqps",
            [(s.rate("kubesgl_request_errors_total", "status, reason"), "{{status}} {{reason}}")],
        ),
        Panel(
            # load shedding: the router sends each to another engine (docs/operator.md, Alerts)
            "Requests refused with 503 per pod (queue full: maxQueuedRequests; or loading, draining)",
            "reqps",
            [(s.rate("kubesgl_request_errors_total", "pod", 'status="503"'), "{{pod}}")],
        ),
        Panel(
            "Tokens per second",
            "short",
            [
                (s.rate("kubesgl_prompt_tokens_total"), "prompt {{model_name}}"),
                (s.rate("kubesgl_generation_tokens_total"), "generated {{model_name}}"),
            ],
        ),
        Panel(
            # a prefill engine answers once the KV is at the decode engine; its TTFT ends at
            # the first token computed (docs/disaggregation.md, Metrics)
            "Time to first token computed (the handoff to decode left out)"
            if prefill
            else "Time to first token",
            "s",
            s.latency("kubesgl_time_to_first_token_seconds"),
        ),
        Panel("End-to-end request latency", "s", s.latency("kubesgl_e2e_request_latency_seconds")),
        Panel(
            "Queue and prefill time" if prefill else "Queue, prefill and decode time",
            "s",
            [
                *s.latency("kubesgl_request_queue_time_seconds", "queue "),
                (
                    s.quantile(0.99, "kubesgl_request_prefill_time_seconds"),
                    "prefill p99 {{model_name}}",
                ),
            ]
            + (
                []
                if prefill  # a room handed off has no decode time here
                else [
                    (
                        s.quantile(0.99, "kubesgl_request_decode_time_seconds"),
                        "decode p99 {{model_name}}",
                    )
                ]
            ),
        ),
        Panel(
            "Running and waiting requests (peaks: the busiest pod's highest sample in the interval)",
            "short",
            [
                (s.gauge("kubesgl_num_running_requests", "sum"), "running {{model_name}}"),
                (s.gauge("kubesgl_num_waiting_requests", "sum"), "waiting {{model_name}}"),
                (
                    s.peak("kubesgl_num_running_requests", "max"),
                    "peak running on one pod {{model_name}}",
                ),
                (
                    s.peak("kubesgl_num_waiting_requests", "max"),
                    "peak waiting on one pod {{model_name}}",
                ),
            ],
        ),
        Panel(
            "KV cache usage (committed / pool), peak per pod",
            "percentunit",
            [(s.peak("kubesgl_kv_cache_usage_ratio", "max", "pod"), "{{pod}}")],
        ),
        Panel(
            "Retractions (running requests re-queued to free KV pages)",
            "ops",
            [(s.rate("kubesgl_retractions_total"), "{{model_name}}")],
        ),
        Panel(
            "Prefix cache hit ratio (cached over prompt tokens)",
            "percentunit",
            [
                (
                    s.ratio("kubesgl_cached_prompt_tokens_total", "kubesgl_prompt_tokens_total"),
                    "{{model_name}}",
                )
            ],
        ),
        Panel(
            # a room handed off has no output length here: the decode engine counts it
            "Prompt lengths (tokens)" if prefill else "Prompt and output lengths (tokens)",
            "short",
            [
                *s.latency("kubesgl_request_prompt_tokens", "prompt "),
                *([] if prefill else s.latency("kubesgl_request_generation_tokens", "output ")),
            ],
        ),
    ]
    if not prefill:  # a prefill engine's only output is the first token
        panels.insert(
            4, Panel("Inter-token latency", "s", s.latency("kubesgl_inter_token_latency_seconds"))
        )
    return Row(f"{role.capitalize()} engines", panels)


def pd_row() -> Row:
    s = Selection(f'{ENGINE_SELECTOR}, role=~"prefill|decode"', "role")
    return Row(
        "Prefill/decode: KV transfers and rooms",
        [
            Panel(
                "KV transfer (prefill to decode)",
                "Bps",
                [(s.rate("kubesgl_kv_transfer_bytes_total"), "{{role}}")],
            ),
            Panel("KV transfer time", "s", s.latency("kubesgl_kv_transfer_seconds")),
            Panel(
                "Requests with a room, by state",
                "short",
                [(s.gauge("kubesgl_disagg_requests", "sum", "role, state"), "{{role}} {{state}}")],
            ),
            Panel(
                "Failed rooms by reason",
                "ops",
                [(s.rate("kubesgl_disagg_failures_total", "role, reason"), "{{role}} {{reason}}")],
            ),
            Panel(
                "Wait for the other engine (decode: for the KV; prefill: for the slots)",
                "s",
                s.latency("kubesgl_kv_transfer_wait_seconds"),
            ),
        ],
    )


def router_row() -> Row:
    s = Selection(SELECTOR, "pod")
    # A worker's pod name where discovery knows it (the info series is 1 per worker and router replica)
    worker_pod = f"on (worker) group_left (worker_pod) max by (worker, worker_pod) (kubesgl_router_worker_info{{{SELECTOR}}})"
    failed = 'worker!="", status!~"2..|cancelled"'
    return Row(
        "Router",
        [
            Panel(
                # once per client request, after any retries (a worker's 503 sent elsewhere is
                # none); a stream broken off after it started is also a 200 answer
                "Answers to clients by status (the router's own rejections among them, by "
                "reason; streams broken off after they started 200)",
                "reqps",
                [
                    (s.rate("kubesgl_router_responses_total", "status"), "{{status}}"),
                    (
                        s.rate("kubesgl_router_rejections_total", "status, reason"),
                        "{{status}} {{reason}} (router)",
                    ),
                    (
                        s.rate("kubesgl_router_broken_streams_total", "reason"),
                        "broken off ({{reason}})",
                    ),
                ],
            ),
            Panel(
                "Failed attempts per worker (errors and 4xx/5xx answers)",
                "reqps",
                [
                    (
                        f"{s.rate('kubesgl_router_requests_total', 'worker, status', failed)} * {worker_pod}",
                        "{{worker_pod}} {{worker}} {{status}}",
                    )
                ],
            ),
            Panel("Request duration", "s", s.latency("kubesgl_router_request_duration_seconds")),
            Panel(
                "Time to first byte (streams: about the time to first token)",
                "s",
                s.latency("kubesgl_router_time_to_first_byte_seconds"),
            ),
            Panel(
                "Healthy workers",
                "short",
                [(s.gauge("kubesgl_router_worker_healthy", "max", "worker"), "{{worker}}")],
            ),
            Panel(
                "In-flight requests per worker (summed over router replicas; peak: each replica's highest)",
                "short",
                [
                    (s.gauge("kubesgl_router_worker_load", "sum", "worker"), "{{worker}}"),
                    (s.peak("kubesgl_router_worker_load", "sum", "worker"), "peak {{worker}}"),
                ],
            ),
            Panel(
                "Cache-aware decisions",
                "ops",
                [(s.rate("kubesgl_router_cache_decisions_total", "decision"), "{{decision}}")],
            ),
            Panel("Retries", "ops", [(s.rate("kubesgl_router_retries_total"), "{{pod}}")]),
            Panel(
                "P/D routes",
                "reqps",
                [(s.rate("kubesgl_router_pd_routes_total", "route"), "{{route}}")],
            ),
        ],
    )


def scrape_row() -> Row:
    s = Selection(SELECTOR, "pod")
    return Row(
        "Scrape health",
        [
            Panel(
                "Scrape health (1: Prometheus reached the pod's /metrics)",
                "short",
                [(s.gauge("up", "min"), "{{pod}}")],
            ),
            Panel("Scrape duration", "s", [(s.gauge("scrape_duration_seconds", "max"), "{{pod}}")]),
        ],
    )


ROWS = [router_row(), *(engine_row(role) for role in ROLES), pd_row(), scrape_row()]


def datasource() -> dict:
    return {"type": "prometheus", "uid": "${datasource}"}


def layout(rows: list[Row]) -> list[dict]:
    """Grafana's flat panel list: each row header, then its panels two to a line."""
    panels: list[dict] = []
    y = 0
    for row in rows:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        for index, spec in enumerate(row.panels):
            panels.append(
                {
                    "id": len(panels) + 1,
                    "type": "timeseries",
                    "title": spec.title,
                    "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": y + 8 * (index // 2)},
                    "datasource": datasource(),
                    "fieldConfig": {"defaults": {"unit": spec.unit}, "overrides": []},
                    "targets": [
                        {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(spec.targets)
                    ],
                }
            )
        y += 8 * -(-len(row.panels) // 2)
    return panels


def label_variable(name: str, query: str, all_value: str | None = None) -> dict:
    variable = {
        "name": name,
        "type": "query",
        "datasource": datasource(),
        "query": {"query": query, "refId": name},
        "includeAll": True,
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }
    if all_value is not None:
        variable["allValue"] = all_value
    return variable


def dashboard() -> dict:
    engines = 'kubesgl_num_running_requests{namespace=~"$namespace", app_kubernetes_io_instance=~"$instance"}'
    return {
        "uid": "kubesgl",
        "title": "kubesgl",
        "tags": ["kubesgl", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                label_variable(
                    "namespace", "label_values(kubesgl_num_running_requests, namespace)"
                ),
                label_variable(
                    "instance",
                    'label_values(kubesgl_num_running_requests{namespace=~"$namespace"}, '
                    "app_kubernetes_io_instance)",
                ),
                # All is any value, not a list of those seen: engines of a model served later still show
                label_variable("model", f"label_values({engines}, model_name)", all_value=".*"),
            ]
        },
        "panels": layout(ROWS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    (Path(__file__).parent / "kubesgl.json").write_text(render())
