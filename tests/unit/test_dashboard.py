"""The Grafana dashboard: generated from its script, every query valid PromQL, and every
metric it reads one that the engine or the router really exports."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import promql_parser

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "kubesgl" / "dashboards"


def load_script(path: Path):
    """A generator script of the chart's (not a package's module), imported from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def builder():
    return load_script(DASHBOARDS / "build_dashboard.py")


def committed() -> dict:
    return json.loads((DASHBOARDS / "kubesgl.json").read_text())


def rows() -> dict[str, list[dict]]:
    """The graph panels under each row header, by the row's title."""
    found: dict[str, list[dict]] = {}
    for panel in committed()["panels"]:
        if panel["type"] == "row":
            current = found.setdefault(panel["title"], [])
        else:
            current.append(panel)
    return found


def queries() -> list[str]:
    dashboard = committed()
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
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
    texts = [
        generate_latest(engine.registry).decode(),
        generate_latest(EngineMetrics("prefill").registry).decode(),
    ]
    workers = WorkerRegistry()
    workers.add("http://worker:30000", Role.MIXED)
    router = RouterMetrics(workers)
    router.requests.labels(worker="w", status="200").inc()
    router.request_duration.observe(0.1)
    router.cache_decisions.labels(decision="hit").inc()
    router.retries.inc()
    texts.append(router.render().decode())
    return {
        sample.name
        for text in texts
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_committed_dashboard_is_the_generated_one():
    assert (DASHBOARDS / "kubesgl.json").read_text() == builder().render()


def test_every_query_parses_as_promql():
    for expr in queries():
        grafana_free = expr.replace("$__rate_interval", "5m")
        for variable in ("$namespace", "$instance", "$model"):
            grafana_free = grafana_free.replace(variable, ".*")
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
    read their peak over the interval, in every engine row; the in-flight load of a worker is
    the sum over router replicas, each of which counts only its own."""
    exprs = queries()
    for expr in exprs:
        if "histogram_quantile(" in expr or " / " in expr:
            assert expr.endswith(">= 0"), expr
    for role in ("Mixed", "Prefill", "Decode"):
        row = [target["expr"] for panel in rows()[f"{role} engines"] for target in panel["targets"]]
        for metric in (
            "kubesgl_num_waiting_requests",
            "kubesgl_num_running_requests",
            "kubesgl_kv_cache_usage_ratio",
        ):
            assert any(f"max_over_time({metric}" in expr for expr in row), (role, metric)
    load = [expr for expr in exprs if "kubesgl_router_worker_load" in expr]
    assert load and all(expr.startswith("sum by (worker)") for expr in load)
    assert any("max_over_time(kubesgl_router_worker_load" in expr for expr in load)


def test_a_row_per_role_for_the_router_pd_and_scrape_health():
    """Issue 15, Build 2: each engine row reads its own role only, every engine query follows the
    model variable (the router's series and `up` have no model_name: they must not), and the
    P/D, router and scrape rows read what they are named after."""
    by_row = {
        title: [target["expr"] for panel in panels for target in panel["targets"]]
        for title, panels in rows().items()
    }
    assert list(by_row) == [
        "Router",
        "Mixed engines",
        "Prefill engines",
        "Decode engines",
        "Prefill/decode: KV transfers and rooms",
        "Scrape health",
    ]
    for role in ("mixed", "prefill", "decode"):
        for expr in by_row[f"{role.capitalize()} engines"]:
            assert re.findall(r'role=~?"([^"]*)"', expr) == [role] * expr.count("role="), expr
            assert "kubesgl_router_" not in expr and "kubesgl_disagg_" not in expr, expr
    engine_metrics = [
        expr
        for expr in queries()
        if re.search(r"\bkubesgl_(?!router_)", expr) and not expr.startswith("label_values(")
    ]
    assert all('model_name=~"$model"' in expr for expr in engine_metrics)
    assert not any("model_name" in expr for expr in by_row["Router"] + by_row["Scrape health"])
    assert all(
        re.search(r"\bkubesgl_(kv_transfer|disagg)_", expr)
        for expr in by_row["Prefill/decode: KV transfers and rooms"]
    )
    assert all("kubesgl_router_" in expr for expr in by_row["Router"])
    assert any(expr.startswith("min by (pod) (up{") for expr in by_row["Scrape health"])
    # the router shows per-worker failures by pod name where discovery knows it
    assert any("group_left (worker_pod)" in expr for expr in by_row["Router"])
    (model,) = [v for v in committed()["templating"]["list"] if v["name"] == "model"]
    assert model["allValue"] == ".*" and model["query"]["query"].endswith(", model_name)")


def test_panels_do_not_overlap():
    taken: set[tuple[int, int]] = set()
    for panel in committed()["panels"]:
        grid = panel["gridPos"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells


def test_load_shedding_shows_per_engine_pod_and_in_the_routers_answers():
    """Engines whose queues are full (--max-queued-requests) refuse with 503, which the router
    sends elsewhere (KubesglEngineQueueFull): each engine row shows the 503s per pod, and the
    router row the 503s the router itself answered to clients, by reason."""
    by_row = {
        title: [target["expr"] for panel in panels for target in panel["targets"]]
        for title, panels in rows().items()
    }
    for role in ("Mixed", "Prefill", "Decode"):
        assert any(
            expr.startswith("sum by (pod) (rate(kubesgl_request_errors_total{")
            and 'status="503"' in expr
            for expr in by_row[f"{role} engines"]
        ), role
    assert any(
        expr.startswith("sum by (status, reason) (rate(kubesgl_router_rejections_total{")
        for expr in by_row["Router"]
    )


def test_the_routers_answers_by_status_are_what_clients_got():
    """kubesgl_router_responses_total, once per client request (a worker's 503 that the router
    retried elsewhere is none, one passed on after every try is), with the streams broken off
    after they started and the router's own rejections by reason; the attempts on workers are
    the failed attempts panel's."""
    (panel,) = [p for p in rows()["Router"] if p["title"].startswith("Answers")]
    exprs = [target["expr"] for target in panel["targets"]]
    assert exprs[0].startswith("sum by (status) (rate(kubesgl_router_responses_total{")
    assert any(
        expr.startswith("sum by (reason) (rate(kubesgl_router_broken_streams_total{")
        for expr in exprs
    )
    assert not any("kubesgl_router_requests_total" in expr for expr in exprs)
