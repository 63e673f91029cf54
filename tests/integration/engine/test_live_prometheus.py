"""Issue 15: a real Prometheus scrapes two mixed CPU engines behind a router and a
prefill/decode pair behind a P/D router (a router takes either mixed or P/D workers, not both),
with the labels the rendered PodMonitor gives, under a short scripted load with aborts, errors,
rejections and a worker outage; then every dashboard query, every autoscaling query (KEDA's, and
each prometheus-adapter rule's as the adapter fills it in for the operator's HPAs) is evaluated:
each returns data, each value is in its range, and the counts (P/D transfers and rooms
included) equal what the load generator saw. Needs the `prometheus` binary (Debian's package;
.ci/run installs it)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from serve_harness import RunningServer, free_port, start_router

from kubesgl.operator.render.autoscaling import (
    HPA_METRICS,
    INSTANCE_PROMETHEUS_LABEL,
    MAX_OVER_PODS,
    prometheus_query,
)

ROOT = Path(__file__).resolve().parents[3]
PROMETHEUS = shutil.which("prometheus")
# .ci/run installs Prometheus and sets this, so that CI fails rather than skips if the install broke.
REQUIRED = os.environ.get("KUBESGL_REQUIRE_PROMETHEUS") == "1"
if PROMETHEUS is None and REQUIRED:
    raise RuntimeError("KUBESGL_REQUIRE_PROMETHEUS=1 but no prometheus binary is on PATH")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="needs the prometheus binary (apt-get install prometheus)"
)

NAMESPACE, INSTANCE, MODEL = "ci", "live", "tiny"  # MODEL: the engines' --served-model-name
# Pod names as a Deployment's: <deployment>-<replicaset hash>-<suffix> (the KEDA queries match them)
# Every router's options; each is started with --health-check-interval of its own and is used
# once its /health passes (its 503s until then are no rejections).
ROUTER_OPTIONS = (
    "--policy",
    "round_robin",
    "--health-failure-threshold",
    "1",
    "--max-retries",
    "3",
    "--retry-initial-backoff",
    "0.01",
    "--log-level",
    "warning",
    "--pd-min-prefill-tokens",
    "0",  # P/D: these short prompts too
)
PODS = {
    "a": "live-mixed-5f7c9-aaaaa",
    "b": "live-mixed-5f7c9-bbbbb",
    "router": "live-router-5f7c9-rrrrr",
    "prefill": "live-prefill-5f7c9-ppppp",
    "decode": "live-decode-5f7c9-ddddd",
    "pd_router": "live-router-5f7c9-sssss",
}
DEPLOYMENTS = {"mixed": "live-mixed", "prefill": "live-prefill", "decode": "live-decode"}
ADAPTER_VALUES = ROOT / "charts" / "kubesgl" / "prometheus-adapter-values.yaml"


def dashboard_queries() -> list[tuple[str, str]]:
    path = ROOT / "charts" / "kubesgl" / "dashboards" / "kubesgl.json"
    dashboard = json.loads(path.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def grafana_free(expr: str, window: str) -> str:
    return (
        expr.replace("$__rate_interval", window)
        .replace("$namespace", NAMESPACE)
        .replace("$instance", INSTANCE)
        .replace("$model", MODEL)
    )


def adapter_rules() -> list[tuple[str, dict]]:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    return [("custom", rule) for rule in rules["custom"]] + [
        ("external", rule) for rule in rules["external"]
    ]


def adapter_metric_name(rule: dict, series: str) -> str | None:
    """The name the adapter serves a series under: name.matches, expanded into name.as."""
    match = re.search(rule["name"]["matches"], series)
    return match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule["name"]["as"])) if match else None


def adapter_query(rule: dict, series: str, matchers: list[str], group_by: str) -> str:
    """metricsQuery as prometheus-adapter fills it in: the series' name, the label matchers
    joined by commas (the metric selector's, sorted by label, then the namespace, then for a
    custom metric the pod names), and the label to group by (pod; none for an external metric)."""
    query = rule["metricsQuery"]
    for field, value in (
        ("Series", series),
        ("LabelMatchers", ",".join(matchers)),
        ("GroupBy", group_by),
    ):
        query = query.replace(f"<<.{field}>>", value)
    assert "<<" not in query, query
    return query


class Prometheus:
    def __init__(self, tmp_path: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = []
        for name, url in targets.items():
            labels = {
                "namespace": NAMESPACE,
                "pod": PODS[name],
                "app_kubernetes_io_instance": INSTANCE,
            }
            jobs.append(f"""  - job_name: {name}
    scrape_interval: 1s
    static_configs:
      - targets: ["{url.removeprefix("http://")}"]
        labels: {json.dumps(labels)}
""")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
            + "".join(jobs)
        )
        self.log = open(tmp_path / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        """The instant query's result at `at` (Unix time; now if None)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        answer = httpx.get(self.url + "/api/v1/query", params=params, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        return [(r["metric"], float(r["value"][1])) for r in answer["data"]["result"]]

    def series(self, match: str) -> list[dict]:
        answer = httpx.get(
            self.url + "/api/v1/series", params={"match[]": match}, timeout=10
        ).json()
        assert answer["status"] == "success", (match, answer)
        return answer["data"]

    def total(self, expr: str) -> float:
        """The sum of a counter's last values, also of series whose pod has gone."""
        return sum(value for _, value in self.query(f"sum(max_over_time({expr}[10m]))"))

    def wait_first_scrapes(self, targets: int, timeout: float = 60) -> None:
        """Until every target was scraped once: Prometheus applies new targets only every 5 s,
        and a counter whose first sample already holds the load's count shows no rate."""
        deadline = time.monotonic() + timeout
        while len(self.query("up == 1")) < targets:
            assert time.monotonic() < deadline, f"only {self.query('up')} scraped"
            time.sleep(0.2)

    def catch_up(self, pod: str, url: str, timeout: float = 60) -> None:
        """Until Prometheus holds the pod's latest counts (a scrape may fail on busy cores)."""
        names = (
            "kubesgl_requests_total",
            "kubesgl_request_errors_total",
            "kubesgl_router_requests_total",
            "kubesgl_router_rejections_total",
            "kubesgl_router_responses_total",
        )
        deadline = time.monotonic() + timeout
        while True:
            text = httpx.get(url + "/metrics", timeout=10).text
            own = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(names)
            )
            scraped = sum(self.total(f'{name}{{pod="{pod}"}}') for name in names)
            if scraped == own:
                return
            assert time.monotonic() < deadline, f"{pod}: Prometheus has {scraped}, the pod {own}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


class Client:
    """Completions through one router, counting what came back."""

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}

    def __init__(self, http: httpx.AsyncClient):
        self.http = http
        self.seen = {"ok": 0, "router_400": 0, "router_404": 0, "engine_400": 0, "aborted": 0}

    async def complete(self, **extra) -> int:
        return (await self.http.post("/v1/completions", json={**self.body, **extra})).status_code

    async def stream(self) -> int:
        async with self.http.stream(
            "POST", "/v1/completions", json={**self.body, "stream": True}
        ) as answer:
            async for _ in answer.aiter_bytes():
                pass
            return answer.status_code

    async def abort(self) -> None:
        request = {**self.body, "stream": True, "max_tokens": 2000, "ignore_eos": True}
        async with self.http.stream("POST", "/v1/completions", json=request) as answer:
            async for _ in answer.aiter_bytes():
                break  # the first chunk arrived: leave
        self.seen["aborted"] += 1

    async def burst(self, completions: int, streams: int, aborts: int = 0) -> None:
        statuses = await asyncio.gather(
            *(self.complete() for _ in range(completions)),
            *(self.stream() for _ in range(streams)),
            *(self.abort() for _ in range(aborts)),
        )
        self.seen["ok"] += sum(status == 200 for status in statuses[: completions + streams])


async def scripted_load(
    router: str, pd_router: str, decode: str, kill_b
) -> tuple[dict[str, int], dict[str, int]]:
    """The load; returns what the client saw at the mixed router and at the P/D router (and
    at the decode engine, asked alone for a room whose prefill engine is not there)."""
    async with (
        httpx.AsyncClient(base_url=router, timeout=60) as http,
        httpx.AsyncClient(base_url=pd_router, timeout=60) as pd_http,
    ):
        mixed, pd = Client(http), Client(pd_http)
        # the P/D pair serves its burst (transfers, and a client that leaves mid-stream) while
        # the mixed engines serve theirs
        await asyncio.gather(mixed.burst(20, 10), pd.burst(4, 2, aborts=1))
        seen, complete = mixed.seen, mixed.complete
        for _ in range(5):
            seen["router_400"] += (
                await http.post("/v1/completions", content=b"{not json")
            ).status_code == 400
        for _ in range(3):
            seen["router_404"] += (await http.get("/nowhere")).status_code == 404
        for _ in range(4):
            seen["engine_400"] += await complete(temperature=-1) == 400
        pd.seen["engine_400"] += await pd.complete(temperature=-1) == 400
        no_prefill = {
            **Client.body,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": free_port(),
            "bootstrap_room": 7,
        }
        lost = await pd_http.post(decode + "/v1/completions", json=no_prefill)
        pd.seen["room_lost"] = lost.status_code
        await asyncio.gather(*(mixed.abort() for _ in range(3)))
        await asyncio.sleep(2)  # a few scrapes while both engines serve
        kill_b()
        statuses = await asyncio.gather(
            *(complete() for _ in range(10))
        )  # some first go to the dead one
        seen["ok"] += sum(status == 200 for status in statuses)
    return mixed.seen, pd.seen


def test_dashboard_and_autoscaling_queries_on_a_live_prometheus(
    server_factory, tiny_model, tmp_path
):
    model = tiny_model("llama")
    bootstrap = free_port()
    engine_args = {
        "a": (),
        "b": (),
        "prefill": ("--role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)),
        "decode": ("--role", "decode"),
    }
    with ThreadPoolExecutor(len(engine_args)) as pool:  # the engines load at once
        started = {
            name: pool.submit(server_factory, model, "--served-model-name", MODEL, *args)
            for name, args in engine_args.items()
        }
        engines: dict[str, RunningServer] = {
            name: future.result() for name, future in started.items()
        }
    with ThreadPoolExecutor(2) as pool:
        # no check during the test after the first (new workers are probed at once): the
        # requests right after the outage find the dead worker, not a check that ran between
        # the kill and them (checks 3 s apart lost that race in CI)
        mixed_started = pool.submit(
            start_router,
            "--worker",
            engines["a"].base_url,
            engines["b"].base_url,
            *ROUTER_OPTIONS,
            "--health-check-interval",
            "600",
            tmp_path=tmp_path,
        )
        pd_started = pool.submit(
            start_router,
            "--prefill",
            f"{engines['prefill'].base_url}@{bootstrap}",
            "--decode",
            engines["decode"].base_url,
            *ROUTER_OPTIONS,
            "--health-check-interval",
            "0.5",
            tmp_path=tmp_path,
        )
        routers = [mixed_started.result(), pd_started.result()]
    router_url, pd_router_url = (router.base_url for router in routers)
    prometheus = Prometheus(
        tmp_path,
        {
            **{name: engine.base_url for name, engine in engines.items()},
            "router": router_url,
            "pd_router": pd_router_url,
        },
    )
    try:
        prometheus.wait_first_scrapes(len(PODS))  # every series at 0 before the load

        def kill_b() -> None:
            prometheus.catch_up(PODS["b"], engines["b"].base_url)
            engines["b"].process.send_signal(signal.SIGKILL)
            engines["b"].process.wait()

        started = time.monotonic()
        seen, pd_seen = asyncio.run(
            scripted_load(router_url, pd_router_url, engines["decode"].base_url, kill_b)
        )
        assert seen == {
            "ok": 40,
            "router_400": 5,
            "router_404": 3,
            "engine_400": 4,
            "aborted": 3,
        }, seen
        assert pd_seen == {
            "ok": 6,
            "router_400": 0,
            "router_404": 0,
            "engine_400": 1,
            "aborted": 1,
            "room_lost": 502,
        }, pd_seen
        for name in ("a", "prefill", "decode"):
            engines[name].wait_idle()
            prometheus.catch_up(PODS[name], engines[name].base_url)
        prometheus.catch_up(PODS["router"], router_url)
        prometheus.catch_up(PODS["pd_router"], pd_router_url)
        time.sleep(2)
        window = f"{math.ceil(time.monotonic() - started) + 10}s"  # rates over the whole load
        at = time.time()  # the window ends here for every panel, however long their queries take

        # Every panel query returns data, in its range
        for title, expr in dashboard_queries():
            result = prometheus.query(grafana_free(expr, window), at)
            if not result:  # which targets were scraped, and how often successfully
                scrapes = [
                    prometheus.query(f"{over}_over_time(up[{window}])", at)
                    for over in ("count", "sum")
                ]
                raise AssertionError(
                    f"{title}: no data for {expr} (scrapes, successful: {scrapes})"
                )
            for labels, value in result:
                assert not math.isnan(value), (title, expr, labels)
                assert value >= 0, (title, expr, labels, value)
                bounded = (
                    "_ratio",
                    "kubesgl_cached_prompt_tokens_total",
                    "kubesgl_router_worker_healthy",
                    "(up{",
                )
                if any(name in expr for name in bounded):
                    assert value <= 1, (title, expr, labels, value)
                if "histogram_quantile" in expr:  # seconds, or lengths (max_tokens is at most 2000)
                    assert value < (2048 if "_tokens_bucket" in expr else 60), (
                        title,
                        expr,
                        labels,
                        value,
                    )
        # every engine series names the served model (the dashboard's model filter relies on it)
        engine_series = prometheus.series(
            f'{{__name__=~"kubesgl_.+", __name__!~"kubesgl_router_.+", namespace="{NAMESPACE}"}}'
        )
        assert engine_series and {series.get("model_name") for series in engine_series} == {MODEL}
        # ... and so does the router's info series of each worker, which asked the worker's /v1/models
        info = prometheus.query(f'kubesgl_router_worker_info{{namespace="{NAMESPACE}"}}')
        assert sorted(labels["model_name"] for labels, _ in info) == [MODEL] * 4, info
        # the outage shows: engine b's scrapes fail, and its router-side health went to 0
        up = dict(
            (labels["pod"], value)
            for labels, value in prometheus.query(f'up{{namespace="{NAMESPACE}"}}')
        )
        assert up == {pod: float(name != "b") for name, pod in PODS.items()}

        # Every autoscaling query of every role returns data, in its range
        for role, deployment in DEPLOYMENTS.items():
            for metric in HPA_METRICS:
                result = prometheus.query(prometheus_query(NAMESPACE, deployment, role, metric))
                assert len(result) == 1, (role, metric, result)
                value = result[0][1]
                assert 0 <= value and not math.isnan(value), (role, metric, value)
                if metric == "kvCacheUsage":
                    assert value <= 1
                if metric == "timeToFirstToken":
                    assert 0 < value < 60
        # no traffic: the latency quantile is 0, not NaN (which KEDA would take for a value)
        idle = prometheus_query("idle", "idle-decode", "decode", "timeToFirstToken")
        assert [value for _, value in prometheus.query(idle)] == [0.0]

        # Every prometheus-adapter rule finds its series and names exactly the metrics the
        # operator's HPAs ask for; each query the adapter builds for them returns data in range
        served: dict[str, tuple[str, dict, str]] = {}
        for kind, rule in adapter_rules():
            found = {series["__name__"] for series in prometheus.series(rule["seriesQuery"])}
            assert found, rule["seriesQuery"]
            served.update(
                {adapter_metric_name(rule, series): (kind, rule, series) for series in found}
            )
        asked = {MAX_OVER_PODS.get(metric, name) for metric, name in HPA_METRICS.items()}
        assert set(served) == asked, (sorted(served), sorted(asked))
        pods = [PODS["a"], PODS["b"]]  # the Deployment's pods, as the HPA lists them
        pod_names = "|".join(pods)
        for name, (kind, rule, series) in served.items():
            if kind == "custom":
                query = adapter_query(
                    rule, series, [f'namespace="{NAMESPACE}"', f'pod=~"{pod_names}"'], "pod"
                )
            else:  # the HPA's selector: the InferenceService and role
                selector = {INSTANCE_PROMETHEUS_LABEL: INSTANCE, "role": "mixed"}
                matchers = [f'{label}="{value}"' for label, value in sorted(selector.items())]
                query = adapter_query(rule, series, [*matchers, f'namespace="{NAMESPACE}"'], "")
            result = prometheus.query(query)
            assert result, (name, query)
            assert kind == "custom" or len(result) == 1, (name, result)
            for labels, value in result:
                assert kind == "external" or labels["pod"] in pods, (name, labels)
                assert 0 <= value and not math.isnan(value), (name, query, value)
                assert value <= (1 if name.startswith("kubesgl_kv_cache_usage") else 60), (
                    name,
                    value,
                )
            if name == "kubesgl_time_to_first_token_seconds_avg":
                assert dict((labels["pod"], value) for labels, value in result)[PODS["a"]] > 0

        # The counts are what the client saw
        def total(expr: str, pod: str) -> float:
            """A counter of one pod (the name with its label matchers, if any)."""
            name, _, matchers = expr.partition("{")
            return prometheus.total(f'{name}{{pod="{PODS[pod]}",{matchers.rstrip("}")}}}')

        assert (
            total('kubesgl_router_rejections_total{status="400"}', "router") == seen["router_400"]
        )
        assert (
            total('kubesgl_router_rejections_total{status="404"}', "router") == seen["router_404"]
        )
        assert (
            total("kubesgl_router_rejections_total", "router")
            == seen["router_400"] + seen["router_404"]
        )

        # The answers the clients got, once per request: an aborted stream had started 200,
        # and a request whose attempt failed in the outage was retried and answered once
        def answers(router: str) -> dict[str, float]:
            counted = {
                status: total(f'kubesgl_router_responses_total{{status="{status}"}}', router)
                for status in ("200", "400", "404")
            }
            assert total("kubesgl_router_responses_total", router) == sum(counted.values())
            assert total("kubesgl_router_broken_streams_total", router) == 0
            return counted

        assert answers("router") == {
            "200": seen["ok"] + seen["aborted"],
            "400": seen["router_400"] + seen["engine_400"],
            "404": seen["router_404"],
        }
        assert answers("pd_router") == {
            "200": pd_seen["ok"] + pd_seen["aborted"],
            "400": pd_seen["engine_400"],
            "404": 0,
        }
        assert (
            total('kubesgl_router_requests_total{worker!="",status="200"}', "router") == seen["ok"]
        )
        assert (
            total('kubesgl_router_requests_total{worker!="",status="400"}', "router")
            == seen["engine_400"]
        )
        assert (
            total('kubesgl_router_requests_total{worker!="",status="cancelled"}', "router")
            == seen["aborted"]
        )
        failed = total('kubesgl_router_requests_total{worker!="",status="error"}', "router")
        assert (
            failed >= 1 and total("kubesgl_router_retries_total", "router") == failed
        )  # each failure retried
        mixed_total = prometheus.total
        role = '{role="mixed"}'
        assert (
            mixed_total(
                'kubesgl_request_errors_total{role="mixed",status="400",reason="invalid_request"}'
            )
            == seen["engine_400"]
        )
        assert mixed_total(f"kubesgl_request_errors_total{role}") == seen["engine_400"]
        assert (
            mixed_total('kubesgl_requests_total{role="mixed",finish_reason=~"stop|length"}')
            == seen["ok"]
        )
        assert (
            mixed_total('kubesgl_requests_total{role="mixed",finish_reason="abort"}')
            == seen["aborted"]
        )
        finished = seen["ok"] + seen["aborted"]
        assert mixed_total(f"kubesgl_e2e_request_latency_seconds_count{role}") == finished
        assert mixed_total(f"kubesgl_request_queue_time_seconds_count{role}") == finished
        # P/D: each request is one room on either engine; the prefill engine wrote the KV of each
        # P/D: the router sent each request to both engines; the prefill engine finished its part
        # (the first token) of each, also of the one the client left, and wrote its KV; the
        # room the load generator named with no prefill engine behind it failed on the decode
        # engine as peer_lost, and no room is left in any state
        sent = pd_seen["ok"] + pd_seen["aborted"]
        # a request the engines refused (their 400) was served no route
        assert total('kubesgl_router_pd_routes_total{route="disaggregated"}', "pd_router") == sent
        # two attempts per request, one per engine: the decode side of an aborted request is
        # cancelled, its prefill side too unless it had answered; the side of a refused request
        # that answers second is cancelled unless its 400 came first
        attempts = {
            status: total(f'kubesgl_router_requests_total{{status="{status}"}}', "pd_router")
            for status in ("200", "400", "cancelled", "error")
        }
        assert sum(attempts.values()) == 2 * (sent + pd_seen["engine_400"]), attempts
        assert 2 * pd_seen["ok"] <= attempts["200"] <= 2 * pd_seen["ok"] + pd_seen["aborted"], (
            attempts
        )
        assert pd_seen["engine_400"] <= attempts["400"] <= 2 * pd_seen["engine_400"], attempts
        assert attempts["error"] == 0, attempts
        assert total("kubesgl_router_rejections_total", "pd_router") == 0
        # a prefill engine's rooms are handed off, not finished: the decode engine counts how
        # each ends
        assert total('kubesgl_requests_total{finish_reason="handoff"}', "prefill") == sent
        assert total('kubesgl_requests_total{finish_reason=~"stop|length|abort"}', "prefill") == 0
        assert (
            total('kubesgl_requests_total{finish_reason=~"stop|length"}', "decode") == pd_seen["ok"]
        )
        assert (
            total('kubesgl_requests_total{finish_reason="abort"}', "decode") == pd_seen["aborted"]
        )
        assert total("kubesgl_kv_transfer_seconds_count", "prefill") == sent
        assert total("kubesgl_kv_transfer_bytes_total", "prefill") > 0
        for role in ("prefill", "decode"):
            assert total("kubesgl_kv_transfer_wait_seconds_count", role) == sent, role
            assert (
                total('kubesgl_request_errors_total{status="400"}', role) == pd_seen["engine_400"]
            ), role
        assert total('kubesgl_request_errors_total{status!="400"}', "prefill") == 0
        assert total('kubesgl_request_errors_total{status!="400"}', "decode") == 1
        assert total('kubesgl_disagg_failures_total{reason="peer_lost"}', "decode") == 1
        assert total('kubesgl_disagg_failures_total{reason!="peer_lost"}', "decode") == 0
        assert total("kubesgl_disagg_failures_total", "prefill") == 0
        rooms = prometheus.query(f'sum(kubesgl_disagg_requests{{namespace="{NAMESPACE}"}})')
        assert rooms == [({}, 0)], rooms
        # the outage's failed attempts are seen by increase(): their series existed at 0 before
        # (one that appeared holding its first count would show no increase)
        errors = prometheus.query(
            f'sum(increase(kubesgl_router_requests_total{{status="error"}}[{window}]))', at
        )
        assert errors and errors[0][1] > 0.5 * failed, (errors, failed)
    finally:
        prometheus.stop()
        for router in routers:
            router.stop(timeout=30)
