"""The Grafana dashboard: generated from its script, every query valid PromQL, and every
metric it reads one that the engine or the router really exports."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import promql_parser

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "kubesgl" / "dashboards"


def builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", DASHBOARDS / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def queries() -> list[str]:
    dashboard = json.loads((DASHBOARDS / "kubesgl.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def exported_metric_names() -> set[str]:
    """Sample names as Prometheus stores them (_total, _bucket, _sum, _count included)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kubesgl.engine.metrics import EngineMetrics
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.workers import Role, WorkerRegistry

    engine = EngineMetrics("mixed")
    engine.requests.labels(role="mixed", finish_reason="stop").inc()
    texts = [generate_latest(engine.registry).decode(), generate_latest(EngineMetrics("prefill").registry).decode()]
    workers = WorkerRegistry()
    workers.add("http://worker:30000", Role.MIXED)
    router = RouterMetrics(workers)
    router.requests.labels(worker="w", status="200").inc()
    router.request_duration.observe(0.1)
    router.cache_decisions.labels(decision="hit").inc()
    router.retries.inc()
    texts.append(router.render().decode())
    return {sample.name for text in texts for family in text_string_to_metric_families(text) for sample in family.samples}


def test_committed_dashboard_is_the_generated_one():
    assert (DASHBOARDS / "kubesgl.json").read_text() == builder().render()


def test_every_query_parses_as_promql():
    for expr in queries():
        grafana_free = expr.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$instance", ".*")
        if grafana_free.startswith("label_values("):
            grafana_free = re.sub(r"^label_values\((.*), *\w+\)$", r"\1", grafana_free)
        promql_parser.parse(grafana_free)  # raises on a syntax error


def test_every_metric_the_dashboard_reads_is_exported():
    exported = exported_metric_names()
    read = {name for expr in queries() for name in re.findall(r"\bkubesgl_[a-z0-9_]+", expr)}
    assert read and read <= exported, sorted(read - exported)


def test_idle_intervals_give_no_nan_and_bursts_show():
    """Issue 15: a quantile or a ratio over an interval without observations is NaN (the KV
    transfer time while nothing transfers): each drops it; gauges where a short burst matters
    read their peak over the interval; the in-flight load of a worker is the sum over router
    replicas, each of which counts only its own."""
    exprs = queries()
    for expr in exprs:
        if "histogram_quantile(" in expr or " / " in expr:
            assert expr.endswith(">= 0"), expr
    for metric in ("kubesgl_num_waiting_requests", "kubesgl_kv_cache_usage_ratio"):
        assert any(f"max_over_time({metric}" in expr for expr in exprs), metric
    (load,) = [expr for expr in exprs if "kubesgl_router_worker_load" in expr]
    assert load.startswith("sum by (worker)")
