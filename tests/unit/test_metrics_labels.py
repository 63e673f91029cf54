"""Known label values exist from the start, at zero: a series that appears already holding its
first count is invisible to rate() and increase() (issue 15)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubesgl.engine.metrics import FINISH_REASONS, EngineMetrics
from kubesgl.router.metrics import CACHE_DECISIONS, PD_ROUTES, WORKER_STATUSES, RouterMetrics
from kubesgl.router.workers import Role, WorkerRegistry


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Counter samples (the _total ones) by name, as the label sets they carry."""
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            found[family.name] = [s.labels for s in family.samples if s.name.endswith("_total")]
    return found


def test_every_engine_counter_has_its_series_at_zero_from_the_start():
    for role in ("mixed", "prefill", "decode"):
        counters = samples(generate_latest(EngineMetrics(role).registry).decode())
        for name, series in counters.items():
            if role == "mixed" and name.startswith("kubesgl_disagg_"):
                continue  # P/D rooms only exist on prefill and decode engines
            assert series, f"{name} has no series before its first increment ({role})"
        reasons = {s["finish_reason"] for s in counters["kubesgl_requests"]}
        assert reasons == set(FINISH_REASONS)


def test_engine_finish_reasons_start_at_zero():
    metrics = EngineMetrics("mixed")
    text = generate_latest(metrics.registry).decode()
    for reason in FINISH_REASONS:
        assert f'kubesgl_requests_total{{finish_reason="{reason}",role="mixed"}} 0.0' in text


def test_every_router_counter_has_its_series_at_zero_from_the_start():
    workers = WorkerRegistry()
    workers.add("http://before:30000", Role.MIXED)  # known when the metrics are made
    metrics = RouterMetrics(workers)
    workers.add("http://after:30000", Role.DECODE)  # and one discovered later
    counters = samples(metrics.render().decode())
    for name, series in counters.items():
        assert series, f"{name} has no series before its first increment"
    assert {s["route"] for s in counters["kubesgl_router_pd_routes"]} == set(PD_ROUTES)
    assert {s["decision"] for s in counters["kubesgl_router_cache_decisions"]} == set(CACHE_DECISIONS)
    requests = {(s["worker"], s["status"]) for s in counters["kubesgl_router_requests"]}
    for url in ("http://before:30000", "http://after:30000"):
        assert {(url, status) for status in WORKER_STATUSES} <= requests
    assert ("", "503") in requests
    assert all(value == 0 for family in text_string_to_metric_families(metrics.render().decode())
               if family.type == "counter" for value in (s.value for s in family.samples if s.name.endswith("_total")))
