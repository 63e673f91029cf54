"""Known label values exist from the start, at zero: a series that appears already holding its
first count is invisible to rate() and increase() (issue 15)."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubesgl.engine.metrics import FINISH_REASONS, HANDOFF, EngineMetrics
from kubesgl.router.metrics import (
    BROKEN_STREAM_REASONS,
    CACHE_DECISIONS,
    CONNECTION_LIMIT,
    RESPONSE_STATUSES,
    WORKER_STATUSES,
    PDRoute,
    RouterMetrics,
)
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
        assert reasons == set(FINISH_REASONS) | ({HANDOFF} if role == "prefill" else set())


def test_engine_finish_reasons_start_at_zero():
    metrics = EngineMetrics("mixed")
    text = generate_latest(metrics.registry).decode()
    for reason in FINISH_REASONS:
        assert f'kubesgl_requests_total{{finish_reason="{reason}",role="mixed"}} 0.0' in text


def test_every_engine_sample_names_the_served_model():
    """As vLLM's: model_name on every sample at /metrics (one with labels of its own, a
    histogram's buckets, the build info), beside the labels it was recorded with."""
    metrics = EngineMetrics("decode", "Qwen/Qwen3-0.6B")
    metrics.set_build_info("0.1.0", "Qwen/Qwen3-0.6B")
    metrics.request_error(400)
    metrics.tokens(3, 0.01, first=False)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    exported = [s for family in families for s in family.samples]
    assert len(exported) > 100
    for sample in exported:
        assert (
            sample.labels["model_name"] == "Qwen/Qwen3-0.6B" and sample.labels["role"] == "decode"
        ), sample
    assert {"status": "400", "reason": "invalid_request"}.items() <= next(
        s.labels for s in exported if s.name == "kubesgl_request_errors_total" and s.value == 1
    ).items()
    recorded = [s for family in metrics.registry.collect() for s in family.samples]
    assert len(recorded) == len(exported) and not any("model_name" in s.labels for s in recorded)


def test_every_router_counter_has_its_series_at_zero_from_the_start():
    workers = WorkerRegistry()
    workers.add("http://before:30000", Role.MIXED)  # known when the metrics are made
    metrics = RouterMetrics(workers)
    workers.add("http://after:30000", Role.DECODE)  # and one discovered later
    counters = samples(metrics.render().decode())
    for name, series in counters.items():
        assert series, f"{name} has no series before its first increment"
    assert {s["route"] for s in counters["kubesgl_router_pd_routes"]} == set(PDRoute)
    assert {s["decision"] for s in counters["kubesgl_router_cache_decisions"]} == set(
        CACHE_DECISIONS
    )
    requests = {(s["worker"], s["status"]) for s in counters["kubesgl_router_requests"]}
    for url in ("http://before:30000", "http://after:30000"):
        assert {(url, status) for status in WORKER_STATUSES} <= requests
    assert ("", "503") in requests
    responses = {s["status"] for s in counters["kubesgl_router_responses"]}
    assert {"200", "400", "404", "429", "500", "502", "503", "504"} <= responses
    assert responses == set(RESPONSE_STATUSES)
    broken = {s["reason"] for s in counters["kubesgl_router_broken_streams"]}
    assert broken == set(BROKEN_STREAM_REASONS) == {"worker", "shutdown"}
    assert all(
        value == 0
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.type == "counter"
        for value in (s.value for s in family.samples if s.name.endswith("_total"))
    )


# -- the router counts the answers it gives itself (issue 15, item 2) ------------------------


async def _call(app, method: str, path: str, body: bytes = b"", headers=()) -> int:
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stays until answered
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": list(headers),
        "query_string": b"",
    }
    await app(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def _counter(metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_routers_own_rejections_are_counted_by_status_and_reason():
    from kubesgl.router.app import RouterApp
    from kubesgl.router.config import RouterConfig
    from kubesgl.router.metrics import REJECTION_REASONS

    app = RouterApp(RouterConfig(api_key="k", max_request_bytes=100))
    key = [(b"authorization", b"Bearer k")]
    calls = [  # (expected status, request); no worker is registered
        (404, ("GET", "/nowhere", b"", ())),
        (404, ("GET", "/nowhere/else", b"", ())),
        (405, ("GET", "/v1/completions", b"", ())),
        (401, ("POST", "/v1/completions", b"{}", ())),
        (413, ("POST", "/v1/completions", b"x" * 200, key)),
        (400, ("POST", "/v1/completions", b"not json", key)),
        (403, ("POST", "/workers", b"{}", ())),
        (503, ("POST", "/v1/completions", b'{"prompt": "hi"}', key)),
        (200, ("GET", "/metrics", b"", ())),  # answered: no rejection
    ]

    async def scenario() -> list[int]:
        await app.startup()
        try:
            return [await _call(app, *request) for _, request in calls]
        finally:
            await app.shutdown()

    assert asyncio.run(scenario()) == [status for status, _ in calls]
    expected = {404: 2, 405: 1, 401: 1, 413: 1, 400: 1, 403: 1, 503: 1}
    for status, count in expected.items():
        got = _counter(
            app.metrics,
            "kubesgl_router_rejections_total",
            status=str(status),
            reason=REJECTION_REASONS[status],
        )
        assert got == count, (status, got)
    total = sum(
        s.value
        for family in app.metrics.registry.collect()
        if family.name == "kubesgl_router_rejections"
        for s in family.samples
        if s.name.endswith("_total")
    )
    assert total == sum(expected.values())
    # the no-worker answer is also the attempt counted without a worker, as before
    assert _counter(app.metrics, "kubesgl_router_requests_total", worker="", status="503") == 1


def test_the_answers_clients_got_are_counted_once_by_status_and_probes_are_not():
    """kubesgl_router_responses_total: every answer the router sent, by status, its own
    rejections among them (on any path, as they count in kubesgl_router_rejections_total),
    but not the router's own answers to probes, scrapes and the admin API: /health (its 503
    while no worker can serve included), /liveness, /metrics, GET /workers."""
    from kubesgl.contract import ROUTER_LIVENESS_PATH
    from kubesgl.router.app import RouterApp
    from kubesgl.router.config import RouterConfig

    app = RouterApp(RouterConfig(api_key="k"))
    key = [(b"authorization", b"Bearer k")]
    calls = [  # (expected status, request, counted); no worker is registered
        (404, ("GET", "/nowhere", b"", ()), True),
        (401, ("POST", "/v1/completions", b"{}", ()), True),
        (400, ("POST", "/v1/completions", b"not json", key), True),
        (503, ("POST", "/v1/completions", b'{"prompt": "hi"}', key), True),
        (503, ("POST", "/v1/completions", b'{"prompt": "hi"}', key), True),
        (403, ("POST", "/workers", b"{}", ()), True),  # a rejection, whatever the path
        (405, ("POST", "/metrics", b"", ()), True),
        (200, ("GET", "/metrics", b"", ()), False),
        (503, ("GET", "/health", b"", ()), False),  # readiness: no worker can serve
        (200, ("GET", ROUTER_LIVENESS_PATH, b"", ()), False),
        (200, ("GET", "/workers", b"", ()), False),
    ]

    async def scenario() -> list[int]:
        await app.startup()
        try:
            return [await _call(app, *request) for _, request, _ in calls]
        finally:
            await app.shutdown()

    assert asyncio.run(scenario()) == [status for status, _, _ in calls]
    expected = {404: 1, 401: 1, 400: 1, 503: 2, 403: 1, 405: 1, 200: 0}
    for status, count in expected.items():
        got = _counter(app.metrics, "kubesgl_router_responses_total", status=str(status))
        assert got == count, (status, got)

    def total(family_name: str) -> float:
        return sum(
            s.value
            for family in app.metrics.registry.collect()
            if family.name == family_name
            for s in family.samples
            if s.name.endswith("_total")
        )

    assert total("kubesgl_router_responses") == sum(counted for _, _, counted in calls)
    # each rejection was an answer, and here every answer a rejection
    assert total("kubesgl_router_rejections") == total("kubesgl_router_responses")


def test_an_unexpected_error_is_a_500_answer_and_an_internal_rejection(caplog):
    from kubesgl.router.app import RouterApp
    from kubesgl.router.config import RouterConfig

    app = RouterApp(RouterConfig())

    async def broken(scope, body):
        raise RuntimeError("a bug")

    app._routes["/version"] = {"GET": broken}

    async def scenario() -> int:
        await app.startup()
        try:
            return await _call(app, "GET", "/version")
        finally:
            await app.shutdown()

    assert asyncio.run(scenario()) == 500
    assert "unexpected error in GET /version" in caplog.text
    assert _counter(app.metrics, "kubesgl_router_responses_total", status="500") == 1
    assert (
        _counter(app.metrics, "kubesgl_router_rejections_total", status="500", reason="internal")
        == 1
    )


def test_the_router_writes_one_access_line_per_request_without_keys(caplog):
    from kubesgl.router.app import RouterApp, _request_id
    from kubesgl.router.config import RouterConfig

    app = RouterApp(RouterConfig(api_key="sk-secret"))
    wrong = [(b"authorization", b"Bearer sk-wrong-secret"), (b"x-request-id", b"trace-7")]

    async def scenario() -> list[int]:
        await app.startup()
        try:
            return [
                await _call(app, "POST", "/v1/completions", b'{"prompt": "private words"}', wrong),
                await _call(app, "GET", "/health"),
            ]
        finally:
            await app.shutdown()

    with caplog.at_level("INFO", logger="kubesgl.router.access"):
        assert asyncio.run(scenario()) == [401, 503]
    lines = [r.getMessage() for r in caplog.records if r.name == "kubesgl.router.access"]
    assert len(lines) == 1, lines  # /health at DEBUG
    assert lines[0].startswith("POST /v1/completions 401 request_id=trace-7 ttfb=")
    assert "secret" not in lines[0] and "private" not in lines[0]
    # a request without an id gets one, which the engines get too; one that is no id is replaced
    scope = {"headers": [(b"x-request-id", b"bad id\r\n")]}
    rid = _request_id(scope)
    assert len(rid) == 32 and scope["headers"] == [(b"x-request-id", rid.encode())]


def test_the_routers_workers_are_named_by_pod_where_discovery_knows_it():
    from kubesgl.router.discovery import PodWatcher

    workers = WorkerRegistry()
    metrics = RouterMetrics(workers)
    workers.add("http://static:30000", Role.MIXED)
    watcher = PodWatcher(workers, "ns", {"app": "engine"}, 30000)
    pod = {
        "metadata": {
            "name": "llama-mixed-5f7c9-abcde",
            "labels": {"app": "engine", "kubesgl.io/role": "mixed"},
        },
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 30000}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    watcher._apply("llama-mixed-5f7c9-abcde", pod)
    info = {
        (s.labels["worker"], s.labels["worker_pod"], s.labels["role"])
        for family in metrics.registry.collect()
        if family.name == "kubesgl_router_worker_info"
        for s in family.samples
    }
    assert info == {
        ("http://static:30000", "", "mixed"),
        ("http://10.0.0.7:30000", "llama-mixed-5f7c9-abcde", "mixed"),
    }
    assert workers.get("http://10.0.0.7:30000").describe()["pod"] == "llama-mixed-5f7c9-abcde"


def test_a_worker_that_turns_unhealthy_is_logged_with_the_reason(caplog):
    import aiohttp

    from kubesgl.router.health import HealthChecker, HealthSettings

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: refused
    workers = WorkerRegistry()
    worker = workers.add(f"http://127.0.0.1:{port}", Role.MIXED)
    worker.healthy = True

    async def check() -> None:
        async with aiohttp.ClientSession() as session:
            await HealthChecker(workers, session, HealthSettings(failure_threshold=1), {}).check(
                worker
            )

    other = workers.add("http://127.0.0.2:30000", Role.MIXED)
    other.healthy = True
    with caplog.at_level("WARNING", logger="kubesgl.router"):
        asyncio.run(check())
        workers.mark_lost(other)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith(
            f"worker http://127.0.0.1:{port} is now unhealthy: 1 failed health checks, the "
            "last: GET /health failed: "
        )
        for line in lines
    ), lines
    assert (
        "worker http://127.0.0.2:30000 is now unhealthy: a connection to it was refused, reset or closed"
        in lines
    )


def test_a_removed_workers_series_go_with_it():
    """A worker that leaves the pool (discovery drops its pod, or DELETE /workers) takes its
    series along, also statuses it answered beyond the pre-created ones; an attempt that
    finishes on it after its removal does not bring them back; other workers keep theirs."""
    from kubesgl.router.discovery import PodWatcher
    from kubesgl.router.upstream import Attempt

    workers = WorkerRegistry()
    metrics = RouterMetrics(workers)
    kept = workers.add("http://kept:30000", Role.MIXED)
    watcher = PodWatcher(workers, "ns", {"app": "engine"}, 30000)
    pod = {
        "metadata": {"name": "llama-mixed-5f7c9-abcde", "labels": {"app": "engine"}},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 30000}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    watcher._apply("llama-mixed-5f7c9-abcde", pod)
    gone = workers.get("http://10.0.0.7:30000")
    for worker, status in ((gone, "200"), (gone, "400"), (kept, "200")):
        Attempt(worker, metrics).finish(status, worker_failed=False)
    late = Attempt(gone, metrics)  # still running when the pod goes

    def worker_urls() -> set[str]:
        return {
            s.labels["worker"]
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
            if "worker" in s.labels
        }

    assert worker_urls() == {"", "http://kept:30000", "http://10.0.0.7:30000"}
    watcher._apply("llama-mixed-5f7c9-abcde", None)  # the pod is deleted
    late.finish("200", worker_failed=False)
    assert worker_urls() == {"", "http://kept:30000"}
    assert (
        _counter(metrics, "kubesgl_router_requests_total", worker="http://kept:30000", status="200")
        == 1
    )
    # the same URL joining again starts from zero, with its known statuses
    workers.add("http://10.0.0.7:30000", Role.MIXED, source="admin")
    assert (
        _counter(
            metrics, "kubesgl_router_requests_total", worker="http://10.0.0.7:30000", status="200"
        )
        == 0
    )
    assert (
        metrics.registry.get_sample_value(
            "kubesgl_router_requests_total", {"worker": "http://10.0.0.7:30000", "status": "400"}
        )
        is None
    )
    workers.remove("http://10.0.0.7:30000")  # as DELETE /workers does
    assert worker_urls() == {"", "http://kept:30000"}


ROUTER_ALONE = """
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.workers import Role, WorkerRegistry
registry = WorkerRegistry()
registry.add("http://w:1", Role.MIXED)
print("_created" in RouterMetrics(registry).render().decode())
"""


def test_no_created_series_double_the_scrape():
    """prometheus_client's switch is global to a process: the router's is checked in one that
    imports the router's metrics alone (this one has imported the engine's)."""
    assert "_created" not in EngineMetrics("decode", "m").render().decode()
    router = subprocess.run(
        [sys.executable, "-c", ROUTER_ALONE], capture_output=True, text=True, check=True
    )
    assert router.stdout.strip() == "False", router.stderr


def _help_and_samples(text: str) -> tuple[dict[str, str], set[str]]:
    families = list(text_string_to_metric_families(text))
    helps = {family.name: family.documentation for family in families}
    return helps, {sample.name for family in families for sample in family.samples}


def _router_text() -> str:
    workers = WorkerRegistry()
    workers.add("http://worker:30000", Role.MIXED)
    metrics = RouterMetrics(workers)
    metrics.request_duration.observe(0.1)
    return metrics.render().decode()


def test_help_texts_name_series_as_prometheus_stores_them_and_say_what_they_count():
    """A HELP text that cites another series names one a query can use (the rejections' cited
    kubesgl_router_requests{...}, which has no samples: the counter's are _total); the router's
    attempts include `cancelled`, and KV usage counts the pages reserved for outputs, as
    server.md and router.md say."""
    engine_helps, engine_samples = _help_and_samples(
        generate_latest(EngineMetrics("decode").registry).decode()
    )
    router_helps, router_samples = _help_and_samples(_router_text())
    exported = engine_samples | router_samples
    for name, documentation in {**engine_helps, **router_helps}.items():
        for cited in re.findall(r"\bkubesgl_[a-z0-9_]+", documentation):
            assert cited in exported, (name, cited)
    assert "cancelled" in router_helps["kubesgl_router_requests"]
    assert "reserved" in engine_helps["kubesgl_kv_cache_usage_ratio"]


def test_router_latency_buckets_are_fine_and_a_whole_answer_has_a_long_tail():
    edges: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(_router_text()):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                edges.setdefault(family.name, []).append(float(sample.labels["le"]))
    first_byte = edges["kubesgl_router_time_to_first_byte_seconds"]
    inside = [e for e in first_byte if 0.1 <= e <= 20]
    assert max(b / a for a, b in zip(inside, inside[1:])) <= 1.5
    assert max(edges["kubesgl_router_request_duration_seconds"]) >= 7680


def test_a_no_worker_rejection_is_the_attempt_counted_without_a_worker():
    """kubesgl_router_requests_total{worker=""} counts the no-worker answers, each once (the
    rejection that answers it), and no other 503 of the router's."""
    metrics = RouterMetrics(WorkerRegistry())
    metrics.rejected(503)
    metrics.rejected(503, CONNECTION_LIMIT)
    assert _counter(metrics, "kubesgl_router_requests_total", worker="", status="503") == 1
