"""Failures: a worker killed mid-run, failing workers, health checks, circuit breaker, admin API."""

from __future__ import annotations

import asyncio
import json

import pytest
from router_fakes import KVTransferTable

from kubesgl.router.routing import DisaggregationSettings

pytestmark = pytest.mark.asyncio


def served_by(response) -> str:
    return response.json()["choices"][0]["text"].split("-tok")[0]


def answered(router, status: int) -> float:
    """kubesgl_router_responses_total{status}: the answers clients got with that status."""
    sample = router.app.metrics.registry.get_sample_value(
        "kubesgl_router_responses_total", {"status": str(status)}
    )
    return sample or 0.0


def broken_streams(router, reason: str) -> float:
    sample = router.app.metrics.registry.get_sample_value(
        "kubesgl_router_broken_streams_total", {"reason": reason}
    )
    return sample or 0.0


async def test_worker_killed_mid_run(engines, start_router, client):
    a, b, c = await engines("a"), await engines("b", tokens=3), await engines("c")
    b.hold = asyncio.Event()
    async with start_router(workers=[b.url], policy="round_robin", admin_api_key="k") as router:
        await router.ready()
        # A stream that b has started, and a plain request b is still working on.
        stream_cm = client.stream(
            "POST", router.url + "/v1/completions", json={"prompt": "s", "stream": True}
        )
        stream = await stream_cm.__aenter__()
        lines = (line async for line in stream.aiter_lines() if line)
        assert "b-tok0" in await anext(lines)
        pending = asyncio.ensure_future(
            client.post(router.url + "/v1/completions", json={"prompt": "n"})
        )
        await b.wait_for_requests(2)
        for other in (a, c):
            added = await client.post(
                router.url + "/workers",
                json={"url": other.url},
                headers={"Authorization": "Bearer k"},
            )
            assert added.status_code == 200
        await router.all_healthy()

        await b.kill()

        # The stream already coming from b ends with an error event, then [DONE] as an engine's.
        rest = [line async for line in lines]
        await stream_cm.__aexit__(None, None, None)
        assert len(rest) == 2 and rest[1] == "data: [DONE]"
        error = json.loads(rest[0].removeprefix("data: "))["error"]
        assert b.url in error["message"] and error["code"] is None
        # The request b was working on is not sent on: it may be what killed b. Its client
        # learns why, and b is out of the pool at once, before any health check.
        answer = await pending
        assert answer.status_code == 502 and b.url in answer.json()["error"]["message"]
        assert not router.app.workers.get(b.url).healthy
        # New requests all go to the survivors, without a retry.
        for _ in range(6):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200 and served_by(response) in ("a", "c")
        metrics = (await client.get(router.url + "/metrics")).text
        assert "kubesgl_router_retries_total 0.0" in metrics
        assert f'kubesgl_router_requests_total{{status="error",worker="{b.url}"}}' in metrics

        # After a restart, b rejoins: health checks pass and requests reach it again.
        b.hold = None
        before = len(b.requests)
        await b.restart()
        async with asyncio.timeout(10):
            await router.until(lambda: router.app.workers.get(b.url).healthy)
            while len(b.requests) == before:  # until its circuit breaker lets a request through
                response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
                assert response.status_code == 200
        assert served_by(response) == "b"


@pytest.mark.parametrize(
    ("path", "prompt"),
    [
        ("/v1/completions", {"prompt": "s"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "s"}]}),
        ("/generate", {"text": "s"}),
    ],
    ids=["completions", "chat", "generate"],
)
async def test_a_stream_broken_off_ends_with_an_error_event_then_done(
    path, prompt, engines, start_router, client
):
    """As an engine's stream after its own error event, SGLang's /generate's included."""
    a = await engines("a", tokens=3)
    a.hold = asyncio.Event()
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        body = {**prompt, "stream": True}
        async with client.stream("POST", router.url + path, json=body) as response:
            lines = (line async for line in response.aiter_lines() if line)
            assert "a-tok0" in await anext(lines)
            await a.kill()
            async with asyncio.timeout(5):
                rest = [line async for line in lines]
    assert len(rest) == 2 and rest[1] == "data: [DONE]"
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert "broke off the stream" in error["message"] and error["type"] == "upstream_error"
    # a 200 answer, and a stream broken by its worker
    assert answered(router, 200) == 1 and answered(router, 502) == 0
    assert (broken_streams(router, "worker"), broken_streams(router, "shutdown")) == (1, 0)


async def test_a_restarted_worker_serves_a_burst_at_once(engines, start_router, client):
    """The requests a crash cuts open the worker's circuit; back through its health checks it is
    a new process as far as the router can tell: closed circuit, the whole burst served, and the
    router's /health 200 meanwhile (a cooldown longer than the test: no half-open trial helps)."""
    kv = KVTransferTable()
    prefill = await engines("p", "prefill", kv=kv)
    decode = await engines("d", "decode", kv=kv)
    decode.hold = asyncio.Event()
    async with start_router(
        prefill=[(prefill.url, prefill.bootstrap_port)],
        decode=[decode.url],
        disaggregation=DisaggregationSettings(min_prefill_tokens=0),
        breaker_failure_threshold=5,
        breaker_cooldown_s=600,
    ) as router:
        await router.ready()
        cut = [
            asyncio.ensure_future(
                client.post(router.url + "/v1/completions", json={"prompt": f"long {i}"})
            )
            for i in range(8)
        ]
        await decode.wait_for_requests(8)
        await decode.kill()
        assert {(await answer).status_code for answer in cut} == {502}
        worker = router.app.workers.get(decode.url)
        assert not worker.healthy and worker.breaker.state == "open"

        decode.hold = None
        await decode.restart()
        await router.until(lambda: worker.healthy, timeout=10)
        listing = (await client.get(router.url + "/workers")).json()["workers"]
        assert {w["url"]: w["circuit"] for w in listing}[decode.url] == "closed"
        burst = await asyncio.gather(
            *(
                client.post(router.url + "/v1/completions", json={"prompt": f"after {i}"})
                for i in range(6)
            ),
            client.get(router.url + "/health"),
        )
        assert [r.status_code for r in burst] == [200] * 7, [r.text for r in burst]


@pytest.mark.parametrize("stream", [False, True])
async def test_failed_requests_are_retried_on_another_worker(
    engines, start_router, client, stream, caplog
):
    a, b = await engines("a"), await engines("b")
    a.fail_status = 503
    async with start_router(
        workers=[a.url, b.url], policy="round_robin", breaker_cooldown_s=60
    ) as router:
        await router.ready()
        with caplog.at_level("INFO", logger="kubesgl.router"):
            for _ in range(4):
                response = await client.post(
                    router.url + "/v1/completions", json={"prompt": "x", "stream": stream}
                )
                assert response.status_code == 200
                assert "b-tok0" in response.text
        metrics = (await client.get(router.url + "/metrics")).text
        # the clients got four 200s; a's 503s, retried on b, reached none of them
        assert (answered(router, 200), answered(router, 503)) == (4, 0)
    assert len(a.requests) >= 1
    assert "kubesgl_router_retries_total 0.0" not in metrics
    # each retry is logged with the failure behind it: the worker and its answer
    retries = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("retry 1 of 3: ")
    ]
    assert len(retries) == len(a.requests), retries
    assert all(a.url in line and "503" in line for line in retries), retries


async def test_client_errors_are_not_retried(engines, start_router, client):
    a, b = await engines("a"), await engines("b")
    a.fail_status = 400
    async with start_router(workers=[a.url, b.url], policy="round_robin") as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400
    assert len(a.requests) == 1 and b.requests == []


async def test_a_request_that_fails_on_a_worker_is_not_sent_to_the_others(
    engines, start_router, client
):
    """A 500 means the request reached an engine and broke there: it may be a request that
    crashes engines, so it must not visit every worker in turn, nor be sent again by the
    client's SDK."""
    a, b = await engines("a"), await engines("b")
    a.fail_status = b.fail_status = 500
    async with start_router(
        workers=[a.url, b.url], policy="round_robin", breaker_failure_threshold=100
    ) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        metrics = (await client.get(router.url + "/metrics")).text
    assert response.status_code == 500 and "fails on purpose" in response.json()["error"]["message"]
    assert response.headers["x-should-retry"] == "false"  # nor by OpenAI's SDKs, as the engine says
    assert len(a.requests) + len(b.requests) == 1
    assert "kubesgl_router_retries_total 0.0" in metrics


async def test_circuit_breaker_keeps_a_failing_worker_out(engines, start_router, client, caplog):
    a, b = await engines("a"), await engines("b")
    a.fail_status = 500
    async with start_router(
        workers=[a.url, b.url],
        policy="round_robin",
        breaker_failure_threshold=2,
        breaker_cooldown_s=60,
    ) as router:
        await router.ready()
        statuses = []
        with caplog.at_level("WARNING", logger="kubesgl.router"):
            for _ in range(10):
                response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
                statuses.append(response.status_code)
        listing = (await client.get(router.url + "/workers")).json()["workers"]
    # the worker going out of service is logged once, with the failures behind it
    opened = [r.getMessage() for r in caplog.records if "circuit breaker open" in r.getMessage()]
    assert opened == [f"worker {a.url}: circuit breaker open after 2 failed requests (500)"], opened
    assert len(a.requests) == 2  # then its circuit opened, although /health still passes
    assert statuses.count(500) == 2 and statuses.count(200) == 8
    state = {w["url"]: (w["healthy"], w["circuit"]) for w in listing}
    assert state == {a.url: (True, "open"), b.url: (True, "closed")}


async def test_a_worker_that_answers_503_is_busy_not_failing(engines, start_router, client):
    """An engine's 503 says "not now" (its queue full, --max-queued-requests; loading;
    draining): the request goes to another worker, and the busy one's circuit stays closed,
    or a burst would shut an engine out for the cooldown just as its queue drained."""
    a, b = await engines("a"), await engines("b")
    a.fail_status = 503
    async with start_router(
        workers=[a.url, b.url],
        policy="round_robin",
        breaker_failure_threshold=2,
        breaker_cooldown_s=60,
    ) as router:
        await router.ready()
        for _ in range(8):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200 and "b-tok0" in response.text
        listing = (await client.get(router.url + "/workers")).json()["workers"]
    assert len(a.requests) > 2  # asked past the failure threshold, each 503 retried on b
    assert {w["url"]: w["circuit"] for w in listing} == {a.url: "closed", b.url: "closed"}


async def test_all_attempts_failing_returns_the_last_error(engines, start_router, client):
    a = await engines("a")
    a.fail_status = 503  # refused before any work: retried
    async with start_router(workers=[a.url], breaker_failure_threshold=100) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        # the worker's 503, passed on after every try, is the client's one answer
        assert (answered(router, 503), answered(router, 200)) == (1, 0)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    message = response.json()["error"]["message"]
    assert a.url in message and "a fails on purpose" in message
    assert len(a.requests) == 4  # the first attempt and 3 retries


async def test_unhealthy_workers_leave_the_pool_and_come_back(engines, start_router, client):
    a, b = await engines("a"), await engines("b")
    async with start_router(workers=[a.url, b.url], policy="round_robin") as router:
        await router.all_healthy()
        worker_a = router.app.workers.get(a.url)
        a.healthy = False
        await router.until(lambda: not worker_a.healthy, timeout=5)
        for _ in range(4):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert served_by(response) == "b"
        b.healthy = False
        await router.until(lambda: not router.app.can_serve(), timeout=5)
        unavailable = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert unavailable.status_code == 503
        assert "2 failing health checks" in unavailable.json()["error"]["message"]
        a.healthy = True
        await router.until(lambda: worker_a.healthy, timeout=5)
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert served_by(response) == "a"


async def test_admin_endpoints_add_list_and_remove_workers(engines, start_router, client):
    a = await engines("a")
    async with start_router(admin_api_key="s3cret") as router:
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.get(router.url + "/workers")).status_code == 401
        bad = await client.post(
            router.url + "/workers", json={"url": a.url, "role": "chef"}, headers=auth
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
        bad_url = await client.post(router.url + "/workers", json={"url": "ftp://x"}, headers=auth)
        assert bad_url.status_code == 400
        added = await client.post(router.url + "/workers", json={"url": a.url}, headers=auth)
        assert added.json()["worker"]["url"] == a.url
        await router.ready()
        assert (
            await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        ).status_code == 200
        listing = (await client.get(router.url + "/workers", headers=auth)).json()["workers"]
        assert [(w["url"], w["role"], w["source"]) for w in listing] == [(a.url, "mixed", "admin")]
        removed = await client.delete(router.url + "/workers", params={"url": a.url}, headers=auth)
        assert removed.json() == {"removed": a.url}
        again = await client.delete(router.url + "/workers", params={"url": a.url}, headers=auth)
        assert again.status_code == 404
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503


async def test_a_stream_still_running_when_the_shutdown_timeout_ends_is_ended(
    engines, start_router, client
):
    """uvicorn cancels what still runs at the end of the graceful shutdown (FAST's 1 s
    --shutdown-timeout here): a started stream ends with an error event and [DONE], and its
    worker is not blamed."""
    engine = await engines("e", tokens=3)
    engine.hold = asyncio.Event()
    lines: list[str] = []

    async def read() -> None:
        body = {"prompt": "s", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as stream:
            lines.extend([line async for line in stream.aiter_lines() if line])

    async with start_router(workers=[engine.url]) as router:
        await router.ready()
        reader = asyncio.create_task(read())
        worker = router.app.workers.all()[0]
        await router.until(lambda: worker.in_flight == 1)  # the stream has started
    await asyncio.wait_for(reader, 5)
    engine.hold.set()
    assert "e-tok0" in lines[0] and lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert worker.in_flight == 0 and worker.breaker.consecutive_failures == 0
    assert answered(router, 200) == 1
    assert (broken_streams(router, "shutdown"), broken_streams(router, "worker")) == (1, 0)
