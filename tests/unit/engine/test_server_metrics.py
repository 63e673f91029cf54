"""The HTTP server's own accounting (issue 15): error answers by status and reason,
also the body limit's 413, a crash's 500 and an error that ends a stream already started."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import httpx
import pytest

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.messages import FinishReason, TextOutput
from kubesgl.engine.metrics import ERROR_REASONS, EngineMetrics
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerState


class FakeClient:
    """What build_app uses of the EngineClient; `script` says how each request goes."""

    def __init__(self, script: str = "ok"):
        self.metrics = EngineMetrics("mixed")
        self.ready = asyncio.Event()
        self.failure = None  # the engine runs
        self.ready.set()
        self.info = SimpleNamespace(
            vocab_size=1000, context_length=4096, max_total_tokens=8192, kv_layout=None
        )
        self.script = script
        self.probes: list[bool] = []  # each generate call's `request.probe`

    def generate(self, request):
        self.probes.append(request.probe)
        return self._outputs(request.rid)

    async def _outputs(self, rid: str):
        if self.script == "crash":
            raise RuntimeError("boom")
        if self.script == "fail_first":
            yield TextOutput(
                rid, "", [], FinishReason("error", status=500, message="the step failed"), 3, 0, 0
            )
            return
        if self.script == "handoff":  # a prefill engine's answer, after the KV went out
            await asyncio.sleep(0.5)
            yield TextOutput(rid, "a", [5], FinishReason("length"), 3, 0, 1, handoff_seconds=0.5)
            return
        yield TextOutput(rid, "a", [5], None, 3, 0, 1)
        if self.script == "fail_later":
            yield TextOutput(
                rid, "", [], FinishReason("error", status=500, message="the step failed"), 3, 0, 1
            )
            return
        yield TextOutput(rid, "b", [6], FinishReason("length"), 3, 0, 2)

    async def close(self, rid: str, error: str | None = None) -> None:
        pass


def _errors(metrics: EngineMetrics) -> dict[tuple[str, str], float]:
    found = {}
    for family in metrics.registry.collect():
        if family.name == "kubesgl_request_errors":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    found[(sample.labels["status"], sample.labels["reason"])] = sample.value
    return found


async def _responses(
    client: FakeClient, calls, api_key: str | None = None, draining: bool = False
) -> list[httpx.Response]:
    config = EngineConfig(model="m", max_request_body_bytes=2000)
    app = build_app(client, ServerState(config, "m", api_key=api_key, draining=draining))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        return [await http.request(method, path, **kwargs) for method, path, kwargs in calls]


async def _requests(client: FakeClient, calls, api_key: str | None = None) -> list[int]:
    return [response.status_code for response in await _responses(client, calls, api_key)]


def test_error_answers_are_counted_by_status_and_reason():
    client = FakeClient()
    calls = [
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}),  # 200
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": -1}}),  # 400
        ("POST", "/v1/completions", {"json": {"prompt": "hi", "model": "other"}}),  # 404
        ("GET", "/nowhere", {}),  # 404
        ("GET", "/v1/completions", {}),  # 405
        ("POST", "/v1/completions", {"content": b"x" * 5000}),  # 413
        ("GET", "/health", {}),  # 200
    ]
    statuses = asyncio.run(_requests(client, calls))
    assert statuses == [200, 400, 404, 404, 405, 413, 200]
    assert _errors(client.metrics) == {
        ("400", "invalid_request"): 1,
        ("404", "not_found"): 2,
        ("405", "method_not_allowed"): 1,
        ("413", "too_large"): 1,
    }


def test_a_wrong_key_and_a_server_that_is_not_ready_are_counted():
    client = FakeClient()
    statuses = asyncio.run(
        _requests(client, [("POST", "/v1/completions", {"json": {"prompt": "hi"}})], "key")
    )
    client.ready.clear()
    statuses += asyncio.run(
        _requests(
            client,
            [("POST", "/v1/completions", {"json": {"prompt": "hi"}}), ("GET", "/health", {})],
        )
    )  # a probe's 503 is not counted
    assert statuses == [401, 503, 503]
    assert _errors(client.metrics) == {("401", "unauthorized"): 1, ("503", "unavailable"): 1}


@pytest.mark.parametrize(
    "script, stream, status",
    [
        ("crash", False, 500),
        ("fail_first", False, 500),
        ("fail_later", False, 500),
        ("fail_later", True, 200),
    ],
)
def test_failed_generations_are_counted_once(script, stream, status):
    client = FakeClient(script)
    body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
    assert asyncio.run(_requests(client, [("POST", "/v1/completions", {"json": body})])) == [status]
    assert _errors(client.metrics) == {("500", "internal"): 1}


def test_every_known_reason_is_exported_at_zero_from_the_start():
    metrics = EngineMetrics("decode")
    for status, reason in ERROR_REASONS.items():
        labels = {"role": "decode", "status": str(status), "reason": reason}
        assert metrics.registry.get_sample_value("kubesgl_request_errors_total", labels) == 0


@pytest.mark.parametrize("role", ["prefill", "decode", "mixed"])
def test_the_statuses_of_pd_engines_are_exported_at_zero_from_the_start(role):
    """A room in use or closed (409), the other engine failed (502) or timed out (504): a P/D
    engine's series for them existed only after the first one, so increase() missed it."""
    metrics = EngineMetrics(role)
    for status, reason in ((409, "client_error"), (502, "server_error"), (504, "server_error")):
        labels = {"role": role, "status": str(status), "reason": reason}
        value = metrics.registry.get_sample_value("kubesgl_request_errors_total", labels)
        assert value == (None if role == "mixed" else 0), (role, status)
    metrics.request_error(409)  # counted under the series exported at zero
    if role != "mixed":
        labels = {"role": role, "status": "409", "reason": "client_error"}
        assert metrics.registry.get_sample_value("kubesgl_request_errors_total", labels) == 1


# -- inter-token latency (issue 15, item 3) --------------------------------------------------


def _histogram(metrics: EngineMetrics, name: str) -> tuple[float, float]:
    labels = {"role": metrics.role}
    return (
        metrics.registry.get_sample_value(f"{name}_count", labels),
        metrics.registry.get_sample_value(f"{name}_sum", labels),
    )


def test_tokens_that_arrive_with_the_first_are_no_inter_token_latency():
    metrics = EngineMetrics("mixed")
    metrics.tokens(4, 0.9, first=True)  # the first output holds 4 tokens, 0.9 s after arrival
    assert _histogram(metrics, "kubesgl_time_to_first_token_seconds") == (1, 0.9)
    assert _histogram(metrics, "kubesgl_inter_token_latency_seconds") == (0, 0)  # not 3 x 0.3 s
    metrics.tokens(1, 0.02, first=False)
    metrics.tokens(2, 0.06, first=False)  # two tokens in one output: two intervals of 0.03 s
    count, total = _histogram(metrics, "kubesgl_inter_token_latency_seconds")
    assert count == 3 and total == pytest.approx(0.08)
    assert (
        metrics.registry.get_sample_value(
            "kubesgl_inter_token_latency_seconds_bucket", {"role": "mixed", "le": "0.03"}
        )
        == 3
    )
    assert (
        metrics.registry.get_sample_value("kubesgl_generation_tokens_total", {"role": "mixed"}) == 7
    )


# -- request times and lengths (issue 15, item 4) --------------------------------------------


async def _through_engine_client(
    role: str, outputs: list[TextOutput], delay: float = 0.0, probe: bool = False
):
    """The metrics of an EngineClient that receives `outputs` for request r1 from the
    detokenizer, `delay` seconds after the request was sent; a stream whose last output is not
    final is left there (an abort)."""
    import shutil
    from pathlib import Path

    import zmq

    from kubesgl.engine.ipc import Endpoints, push
    from kubesgl.engine.messages import TextBatch, TokenizeRequest
    from kubesgl.engine.sampling_params import SamplingParams
    from kubesgl.engine.server.engine_client import EngineClient

    endpoints = Endpoints.create()
    client = EngineClient(endpoints, EngineMetrics(role))
    client.start()
    detokenizer = push(zmq.Context.instance(), endpoints.api_in)
    try:
        stream = client.generate(TokenizeRequest("r1", SamplingParams(), probe=probe))
        await asyncio.sleep(delay)
        for out in outputs:
            detokenizer.send_pyobj(TextBatch([out]))
        read = []
        async for out in stream:
            read.append(len(out.token_ids))
            if len(read) == len(outputs):
                break
        await stream.aclose()  # after a last output that is not final: the reader left
        assert read == [len(o.token_ids) for o in outputs]
    finally:
        await client.shutdown()
        detokenizer.close(linger=0)
        await client.aclose()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)
    return client.metrics


@pytest.mark.asyncio
async def test_the_engine_client_records_times_lengths_and_cached_tokens():
    metrics = await _through_engine_client(
        "mixed",
        [
            TextOutput(
                "r1", "ab", [5, 6], None, 40, 32, 2, queue_seconds=0.25, prefill_seconds=0.05
            ),
            TextOutput("r1", "c", [7], FinishReason("stop"), 40, 32, 3),
        ],
    )
    assert _histogram(metrics, "kubesgl_request_queue_time_seconds") == (1, 0.25)
    assert _histogram(metrics, "kubesgl_request_prefill_time_seconds") == (1, 0.05)
    assert _histogram(metrics, "kubesgl_request_decode_time_seconds")[0] == 1
    assert _histogram(metrics, "kubesgl_request_prompt_tokens") == (1, 40)
    assert _histogram(metrics, "kubesgl_request_generation_tokens") == (1, 3)
    labels = {"role": "mixed"}
    assert metrics.registry.get_sample_value("kubesgl_cached_prompt_tokens_total", labels) == 32
    assert metrics.registry.get_sample_value("kubesgl_prompt_tokens_total", labels) == 40


def _samples(metrics: EngineMetrics) -> dict[tuple, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
    }


@pytest.mark.asyncio
async def test_a_health_probe_moves_no_metric():
    """/health_generate's token, every few seconds from a load balancer, is no user's request:
    requests, latencies and token counts would count it, and autoscaling on them."""
    probe = TextOutput(
        "r1", "a", [5], FinishReason("length"), 1, 0, 1, queue_seconds=0.01, prefill_seconds=0.01
    )
    metrics = await _through_engine_client("mixed", [probe], probe=True)
    assert _samples(metrics) == _samples(EngineMetrics("mixed"))


@pytest.mark.asyncio
@pytest.mark.parametrize("probe, aborts", [(False, 1), (True, 0)])
async def test_a_probe_left_before_its_end_is_no_abort(probe, aborts):
    """A /health_generate that timed out: its request is aborted, but no user's abort."""
    metrics = await _through_engine_client(
        "mixed", [TextOutput("r1", "a", [5], None, 1, 0, 1)], probe=probe
    )
    labels = {"role": "mixed", "finish_reason": "abort"}
    assert metrics.registry.get_sample_value("kubesgl_requests_total", labels) == aborts


def test_health_generate_generates_one_token_as_a_probe(caplog):
    client = FakeClient()
    calls: list[tuple[str, str, dict]] = [
        ("GET", "/health_generate", {}),
        ("POST", "/health_generate", {}),
    ]
    with caplog.at_level("INFO", logger="kubesgl.access"):
        answers = asyncio.run(_responses(client, calls))
    assert [(a.status_code, a.text) for a in answers] == [(200, "ok"), (200, "ok")]
    assert client.probes == [True, True]  # which the engine client's metrics leave out
    assert not [r for r in caplog.records if r.name == "kubesgl.access"]  # DEBUG, as /health


@pytest.mark.parametrize(
    "loading, draining, why",
    [(True, False, "the model is still loading"), (False, True, "the server is shutting down")],
)
def test_health_generate_is_an_uncounted_503_while_loading_or_draining(loading, draining, why):
    """As /health: a draining engine must leave every rotation that probes either route."""
    client = FakeClient()
    if loading:
        client.ready.clear()
    calls: list[tuple[str, str, dict]] = [("GET", "/health_generate", {}), ("GET", "/health", {})]
    answers = asyncio.run(_responses(client, calls, draining=draining))
    assert [a.status_code for a in answers] == [503, 503]
    assert answers[0].text == why
    assert client.probes == []  # nothing generated
    assert _errors(client.metrics) == {}


def test_a_probes_other_error_answers_are_counted():
    """Only a probe's 503 (loading, draining) is no request error: a probe without the key
    (401) or one that crashed (500) is."""
    client = FakeClient("crash")
    calls: list[tuple[str, str, dict]] = [("GET", "/health_generate", {})]
    statuses = asyncio.run(_requests(client, calls, api_key="key"))
    statuses += asyncio.run(_requests(client, calls))
    assert statuses == [401, 500]
    assert _errors(client.metrics) == {("401", "unauthorized"): 1, ("500", "internal"): 1}


@pytest.mark.asyncio
async def test_a_prefill_engines_handoff_is_left_out_of_its_ttft_and_is_no_finish_reason():
    """A prefill engine's answer to a room leaves once the KV is at the decode engine; the
    time it waited for that (handoff_seconds) is the decode pool's load, not the prefill
    pool's, and is left out of the TTFT. The request did not finish here: it is counted as
    finish_reason="handoff" (not "length", which skewed the sum over a P/D instance's pods),
    with no decode time, output length or generated token of its own."""
    handoff = 0.6
    metrics = await _through_engine_client(
        "prefill",
        [
            TextOutput(
                "r1",
                "a",
                [5],
                FinishReason("length"),
                40,
                0,
                1,
                queue_seconds=0.01,
                prefill_seconds=0.05,
                handoff_seconds=handoff,
            )
        ],
        delay=handoff + 0.05,
    )
    count, ttft = _histogram(metrics, "kubesgl_time_to_first_token_seconds")
    assert count == 1 and ttft < 0.5
    assert _histogram(metrics, "kubesgl_e2e_request_latency_seconds")[1] >= handoff  # it waited
    assert _histogram(metrics, "kubesgl_request_prefill_time_seconds") == (1, 0.05)
    assert _histogram(metrics, "kubesgl_request_decode_time_seconds") == (0, 0)
    assert _histogram(metrics, "kubesgl_request_generation_tokens") == (0, 0)
    get = metrics.registry.get_sample_value
    by_reason = {
        reason: get("kubesgl_requests_total", {"role": "prefill", "finish_reason": reason})
        for reason in ("stop", "length", "abort", "handoff")
    }
    assert by_reason == {"stop": 0, "length": 0, "abort": 0, "handoff": 1}
    # its one token is the decode engine's first, counted there: once over the P/D instance
    assert get("kubesgl_generation_tokens_total", {"role": "prefill"}) == 0


@pytest.mark.asyncio
async def test_a_rooms_tokens_are_counted_once_over_its_prefill_and_decode_engines():
    """The decode engine's first output holds the token the prefill engine sampled: it counts
    it with the rest (its usage says so too), the prefill engine does not, so that
    sum(rate(kubesgl_generation_tokens_total)) over a P/D instance is what clients received."""
    prefill = await _through_engine_client(
        "prefill",
        [TextOutput("r1", "a", [5], FinishReason("length"), 40, 0, 1, handoff_seconds=0.01)],
    )
    decode = await _through_engine_client(
        "decode",
        [
            TextOutput("r1", "a", [5], None, 40, 0, 1, queue_seconds=0.0, prefill_seconds=0.0),
            TextOutput("r1", "bc", [6, 7], FinishReason("stop"), 40, 0, 3),
        ],
    )
    counted = sum(
        m.registry.get_sample_value("kubesgl_generation_tokens_total", {"role": m.role})
        for m in (prefill, decode)
    )
    assert counted == 3 == _histogram(decode, "kubesgl_request_generation_tokens")[1]


def test_a_prefill_engines_access_line_leaves_the_handoff_out_of_its_ttft(caplog):
    """As its TTFT histogram does: the wait for the decode engine is not the prompt's time."""
    calls = [("POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 1}})]
    with caplog.at_level("INFO", logger="kubesgl.access"):
        assert asyncio.run(_requests(FakeClient("handoff"), calls)) == [200]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kubesgl.access"]
    ttft = float(re.search(r"ttft=([\d.]+)s", line)[1])
    duration = float(re.search(r"duration=([\d.]+)s", line)[1])
    assert ttft < 0.25 and duration >= 0.5, line


def test_only_a_prefill_engine_exports_the_handoff_reason():
    for role, exported in (("prefill", True), ("decode", False), ("mixed", False)):
        labels = {"role": role, "finish_reason": "handoff"}
        value = EngineMetrics(role).registry.get_sample_value("kubesgl_requests_total", labels)
        assert (value == 0) if exported else (value is None), role


def test_capacity_and_build_info():
    from kubesgl.engine.messages import SchedulerStats

    metrics = EngineMetrics("decode")
    metrics.set_build_info("0.1.0", "Qwen/Qwen3-0.6B")
    metrics.update_scheduler(SchedulerStats(1, 0, 512, 8192, 0, 0))
    get = metrics.registry.get_sample_value
    assert get("kubesgl_kv_cache_capacity_tokens", {"role": "decode"}) == 8192
    assert (
        get(
            "kubesgl_build_info", {"role": "decode", "version": "0.1.0", "model": "Qwen/Qwen3-0.6B"}
        )
        == 1
    )


def test_retractions_count_what_the_scheduler_reports_since_start():
    from kubesgl.engine.messages import SchedulerStats

    metrics = EngineMetrics("mixed")
    get = metrics.registry.get_sample_value
    assert get("kubesgl_retractions_total", {"role": "mixed"}) == 0
    for total in (0, 3, 3, 7):
        metrics.update_scheduler(SchedulerStats(1, 0, 512, 8192, 0, 0, retractions=total))
    assert get("kubesgl_retractions_total", {"role": "mixed"}) == 7


# -- logs (issue 15, item 7) ------------------------------------------------------------------


def test_one_access_line_per_request_without_prompt_or_key(caplog):
    client = FakeClient()
    secret_prompt, key = "my secret prompt", "sk-very-secret"
    auth = {"authorization": f"Bearer {key}"}
    calls = [
        (
            "POST",
            "/v1/completions",
            {
                "json": {"prompt": secret_prompt, "max_tokens": 2},
                "headers": {**auth, "x-request-id": "trace-42"},
            },
        ),
        (
            "POST",
            "/v1/completions",
            {"json": {"prompt": secret_prompt, "max_tokens": -1}, "headers": auth},
        ),
        (
            "POST",
            "/v1/completions",
            {"json": {"prompt": secret_prompt}, "headers": {"x-request-id": "a b\nc"}},
        ),
        ("GET", "/health", {}),
    ]
    with caplog.at_level("INFO", logger="kubesgl.access"):
        assert asyncio.run(_requests(client, calls, api_key=key)) == [200, 400, 401, 200]
    lines = [r.getMessage() for r in caplog.records if r.name == "kubesgl.access"]
    assert len(lines) == 3, lines  # /health is logged at DEBUG only
    ok, bad, unauthorized = lines
    # rid is the answer's id: the request's, not that of its one choice (cmpl-...-0)
    assert re.match(r"POST /v1/completions 200 request_id=trace-42 rid=cmpl-[0-9a-f]+ ", ok), ok
    assert "prompt_tokens=3 output_tokens=2 ttft=" in ok and "duration=" in ok
    assert bad.startswith(
        "POST /v1/completions 400 request_id=- rid=- prompt_tokens=0 output_tokens=0 ttft=-"
    )
    assert unauthorized.startswith(
        "POST /v1/completions 401 request_id=- "
    )  # no id that is not an id
    assert not [
        line for line in lines if secret_prompt in line or key in line or "my secret" in line
    ]


def test_answers_carry_the_request_id(caplog):
    """As OpenAI's do (the SDK reads it as `_request_id`): the client's X-Request-Id when it is
    an id, else the answer's own id."""

    async def headers() -> list[str | None]:
        app = build_app(FakeClient(), ServerState(EngineConfig(model="m"), "m"))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            body = {"prompt": "hi", "max_tokens": 2}
            return [
                (await http.post("/v1/completions", json=body, headers=sent)).headers.get(
                    "x-request-id"
                )
                for sent in ({"x-request-id": "trace-42"}, {}, {"x-request-id": "a b"})
            ]

    given, own, not_an_id = asyncio.run(headers())
    assert given == "trace-42"
    assert own is not None and own.startswith("cmpl-")
    assert not_an_id is not None and not_an_id.startswith("cmpl-")


def test_a_stats_line_while_busy_only(caplog):
    from kubesgl.engine.messages import SchedulerStats
    from kubesgl.engine.server.engine_client import EngineClient

    client = EngineClient.__new__(EngineClient)  # only the stats log's state
    client._pending, client.stats_log_interval_s = {}, 0.0
    client._stats_logged_at, client._tokens_since_log, client._prompt_tokens_logged = 0.0, 0, 0
    with caplog.at_level("INFO", logger="kubesgl.engine.server.engine_client"):
        client._tokens_since_log = 500
        client._stats_logged_at = time.perf_counter() - 2.0  # the line before, 2 s ago
        client._log_stats(SchedulerStats(3, 2, 600, 1000, 0, 0))
        client._log_stats(SchedulerStats(0, 0, 0, 1000, 0, 0))  # idle: nothing
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("busy: running=3 waiting=2 kv_usage=0.60 ")
    generated = float(lines[0].split(" generated=")[1].split(" tok/s")[0])
    assert 245 <= generated <= 250, lines  # 500 tokens in a little over 2 s


def test_the_stats_line_shows_a_prefill_engines_work(caplog):
    """A prefill engine generates nothing (its rooms' tokens are the decode engine's), so its
    line must say how fast it takes prompts: the new prompt tokens (not found in the prefix
    cache) admitted since the last line."""
    from kubesgl.engine.messages import SchedulerStats
    from kubesgl.engine.server.engine_client import EngineClient

    client = EngineClient.__new__(EngineClient)  # only the stats log's state
    client._pending, client.stats_log_interval_s = {}, 0.0
    client._stats_logged_at, client._tokens_since_log, client._prompt_tokens_logged = 0.0, 0, 0
    with caplog.at_level("INFO", logger="kubesgl.engine.server.engine_client"):
        client._log_stats(SchedulerStats(1, 0, 600, 1000, 0, 0))
        client._stats_logged_at -= 2.0  # the next line comes 2 s after this one
        client._log_stats(
            SchedulerStats(1, 0, 600, 1000, prompt_tokens=5000, cached_prompt_tokens=1000)
        )
    line = caplog.records[-1].getMessage()
    prompt_rate = float(line.split(" prompt=")[1].split(" tok/s")[0])
    assert 1990 <= prompt_rate <= 2000, line  # 4000 new prompt tokens in a little over 2 s
    assert " generated=0.0 tok/s" in line


# -- histogram buckets -------------------------------------------------------------------------


def _edges(metrics: EngineMetrics, name: str) -> list[float]:
    return [
        float(sample.labels["le"])
        for family in metrics.registry.collect()
        if family.name == name
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "kubesgl_time_to_first_token_seconds",
        "kubesgl_request_queue_time_seconds",
        "kubesgl_request_prefill_time_seconds",
        "kubesgl_kv_transfer_wait_seconds",
        "kubesgl_e2e_request_latency_seconds",
        "kubesgl_request_decode_time_seconds",
    ],
)
def test_latency_buckets_are_fine_where_loaded_engines_latencies_fall(name):
    """A quantile is interpolated inside its bucket: with edges 1, 2.5, 5, 10, 30 s the p90 of a
    TTFT read 35-40 % high. From 0.1 to 20 s neighbouring edges are at most 1.5x apart."""
    edges = _edges(EngineMetrics("prefill"), name)
    inside = [e for e in edges if 0.1 <= e <= 20]
    assert inside[0] == 0.1 and inside[-1] == 20
    assert max(b / a for a, b in zip(inside, inside[1:])) <= 1.5
    for kept in (0.001, 0.25, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0):  # queries may name them
        assert kept in edges, kept


def test_whole_requests_have_a_long_tail_and_lengths_double():
    """A request of several minutes read as 120 s (the last edge); vLLM's end-to-end buckets
    go to 7680 s. Lengths: powers of two from 1 (the comment said x2.5 apart; they doubled)."""
    metrics = EngineMetrics("mixed")
    for name in ("kubesgl_e2e_request_latency_seconds", "kubesgl_request_decode_time_seconds"):
        assert max(_edges(metrics, name)) >= 7680, name
    for name in ("kubesgl_request_prompt_tokens", "kubesgl_request_generation_tokens"):
        assert _edges(metrics, name) == [2.0**i for i in range(18)], name


@pytest.mark.asyncio
async def test_a_request_the_server_ended_mid_stream_is_an_error_not_a_client_abort(monkeypatch):
    """A chunk that failed to be made (a bug): the stream's error event counts it once, as a
    500; its request is aborted in the scheduler as the server's doing, and counted as no
    abort (docs/server.md: an abort is a client that left)."""
    import shutil
    from pathlib import Path

    import zmq
    import zmq.asyncio

    from kubesgl.engine.ipc import Endpoints, pull, push
    from kubesgl.engine.messages import AbortRequest, TextBatch, TokenizeRequest
    from kubesgl.engine.server import api
    from kubesgl.engine.server.engine_client import EngineClient
    from kubesgl.engine.server.openai_format import CompletionFormatter

    class FailingCompletion(CompletionFormatter):
        def chunk(self, choice, out):
            if out.text == "b":
                raise RecursionError("maximum recursion depth exceeded")
            return super().chunk(choice, out)

    monkeypatch.setattr(api, "CompletionFormatter", FailingCompletion)
    endpoints = Endpoints.create()
    client = EngineClient(endpoints, EngineMetrics("mixed"))
    client.info = SimpleNamespace(
        vocab_size=1000, context_length=4096, max_total_tokens=8192, kv_layout=None
    )
    client.ready.set()
    client.start()
    context = zmq.asyncio.Context()
    tokenizer = pull(context, endpoints.tokenizer_in)
    detokenizer = push(context, endpoints.api_in)
    received: list = []

    async def scheduler() -> None:  # generates until aborted, as the engine's processes do
        while True:
            message = await tokenizer.recv_pyobj()
            received.append(message)
            if isinstance(message, TokenizeRequest):
                outputs = [TextOutput(message.rid, t, [5], None, 3, 0, 1) for t in "ab"]
                await detokenizer.send_pyobj(TextBatch(outputs))
            elif isinstance(message, AbortRequest):
                end = TextOutput(message.rid, "", [], FinishReason("abort"), 3, 0, 2)
                await detokenizer.send_pyobj(TextBatch([end]))

    engine = asyncio.create_task(scheduler())
    try:
        app = build_app(client, ServerState(EngineConfig(model="m"), "m"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            body = {"prompt": "hi", "max_tokens": 5, "stream": True}
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200 and "RecursionError" in answer.text
        for _ in range(100):  # the abort's final output frees the request's id
            if not client.in_flight:
                break
            await asyncio.sleep(0.01)
        assert client.in_flight == 0
    finally:
        engine.cancel()
        await client.shutdown()
        context.destroy(linger=0)
        await client.aclose()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)
    (abort,) = [m for m in received if isinstance(m, AbortRequest)]
    assert "client" not in abort.message
    assert _errors(client.metrics) == {("500", "internal"): 1}
    labels = {"role": "mixed", "finish_reason": "abort"}
    assert client.metrics.registry.get_sample_value("kubesgl_requests_total", labels) == 0


def test_an_answer_without_a_token_logs_no_time_to_first_token(caplog):
    """A request refused by its first outputs (a 400 the scheduler gave) logged a TTFT."""
    from kubesgl.engine.server.access import AccessRecord, log_access

    record = AccessRecord(rid="cmpl-1")
    record.first_tokens()
    scope = {"method": "POST", "path": "/v1/completions", "headers": []}
    with caplog.at_level("INFO", logger="kubesgl.access"):
        log_access(scope, 400, record)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kubesgl.access"]
    assert "output_tokens=0 ttft=- " in line, line
