"""Prefill/decode mode against fake prefill and decode engines that check the bootstrap fields."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubesgl.router.routing import DisaggregationSettings, RetrySettings
from kubesgl.router.workers import Role

pytestmark = pytest.mark.asyncio

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


async def pd_pool(engines, kv_table, prefills=1, decodes=1):
    p = [await engines(f"p{i}", "prefill", kv=kv_table) for i in range(prefills)]
    d = [await engines(f"d{i}", "decode", kv=kv_table, tokens=3) for i in range(decodes)]
    return p, d


async def out_of_flight(router) -> None:
    """Until no worker has a request of the router's in flight."""
    while any(w.in_flight for w in router.app.workers.all()):
        await asyncio.sleep(0.02)


def pd_config(prefill, decode, **overrides):
    """Every request disaggregated, however short, unless `disaggregation` says otherwise."""
    return {
        "prefill": [(e.url, e.bootstrap_port) for e in prefill],
        "decode": [e.url for e in decode],
        "disaggregation": DisaggregationSettings(min_prefill_tokens=0),
        **overrides,
    }


async def test_streamed_answer_comes_from_decode_with_bootstrap_fields(
    engines, kv_table, start_router, client
):
    (p,), (d,) = await pd_pool(engines, kv_table)
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/chat/completions", json={**BODY, "stream": True}
        )
    assert response.status_code == 200
    events = [line for line in response.text.splitlines() if line]
    contents = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert contents == ["d0-tok0 ", "d0-tok1 ", "d0-tok2 "] and events[-1] == "data: [DONE]"
    prefill_body, decode_body = p.requests[0]["body"], d.requests[0]["body"]
    assert prefill_body == decode_body  # one request, sent to both
    assert prefill_body["bootstrap_host"] == "127.0.0.1"
    assert prefill_body["bootstrap_port"] == p.bootstrap_port
    assert 0 <= prefill_body["bootstrap_room"] < 2**63
    assert {k: v for k, v in prefill_body.items() if not k.startswith("bootstrap_")} == {
        **BODY,
        "stream": True,
    }


async def test_pairs_spread_and_rooms_differ(engines, kv_table, start_router, client):
    prefills, decodes = await pd_pool(engines, kv_table, prefills=2, decodes=2)
    async with start_router(**pd_config(prefills, decodes, policy="round_robin")) as router:
        await router.ready()
        for i in range(4):
            response = await client.post(router.url + "/generate", json={"text": f"q{i}"})
            assert response.status_code == 200 and response.json()["text"].startswith("d")
    rooms = [r["body"]["bootstrap_room"] for e in prefills for r in e.requests]
    assert len(set(rooms)) == 4
    assert all(len(e.requests) == 2 for e in prefills + decodes)
    # Each prefill is announced with its own bootstrap port.
    for e in prefills:
        assert {r["body"]["bootstrap_port"] for r in e.requests} == {e.bootstrap_port}


async def test_prefill_client_error_reaches_the_client_and_stops_decode(
    engines, kv_table, start_router, client
):
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status = 400
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/chat/completions", json={**BODY, "stream": True}
        )
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "p0 fails on purpose"
        async with asyncio.timeout(2):  # well before the decode's own 5 s KV timeout
            await d.client_gone.wait()
        assert all(w.in_flight == 0 for w in router.app.workers.all())


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_a_request_both_engines_refuse_is_answered_by_each_not_cancelled(
    first, engines, kv_table, start_router, client
):
    """A request that breaks the engines' rules gets a 4xx from each. The router waits for
    the second, which an engine counts as the error it is (cancelled, it counted the request
    as aborted by its client), and answers the decode engine's: the prefill's may be a 409
    for the room the decode engine cancelled when it refused (a trial saw a prompt too long
    answered 409 now and then)."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status, d.fail_status = 409, 400
    (d if first == "prefill" else p).fail_after_s = 0.3
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "d0 fails on purpose"
        assert not p.client_gone.is_set() and not d.client_gone.is_set()
        assert all(w.in_flight == 0 for w in router.app.workers.all())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("late_answer_s", [0.0, 0.3], ids=["prefill-first", "decode-first"])
async def test_prefill_server_error_names_the_prefill_worker(
    stream, late_answer_s, engines, kv_table, start_router, client
):
    """The prefill engine fails the room (and tells its decode engine) before any KV: the
    decode engine fails too, and the client gets the prefill's error, the cause, also when
    the prefill's own answer reaches the router after the decode engine's "room failed"."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status, p.late_answer_s = 500, late_answer_s
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": stream}
        )
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith(f"prefill worker {p.url} answered 500")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_that_fails_before_taking_the_room_has_it_cancelled_at_once(
    stream, engines, kv_table, start_router, client
):
    """The prefill answers 500 without taking the room (a handler's crash, a proxy's error),
    so nobody tells the decode engine, which would wait for the KV until its own timeout (5 s
    in the fake, --disaggregation-timeout in an engine). The router cancels the room at the
    prefill's bootstrap server, which fails it at the decode engine: the client gets the
    prefill's error at once."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status, p.fail_without_room = 500, True
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        started = time.monotonic()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "n": 2, "stream": stream}
        )
        elapsed = time.monotonic() - started
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"].startswith(f"prefill worker {p.url} answered 500")
    assert elapsed < 2.0
    rooms = p.requests[0]["body"]["bootstrap_room"]
    assert [room for room, _ in p.cancelled_rooms] == rooms
    reason = p.cancelled_rooms[0][1]
    assert not reason["aborted"] and f"prefill worker {p.url} answered 500" in reason["reason"]


async def test_a_prefill_that_fails_after_its_kv_was_sent_cancels_nothing_the_decode_needs(
    engines, kv_table, start_router, client
):
    """A cancel after the KV was sent changes nothing at the decode engine: its answer stands."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_after_kv = 500
    d.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        answer = asyncio.ensure_future(
            client.post(router.url + "/v1/completions", json={"prompt": "x"})
        )
        async with asyncio.timeout(2):
            while not p.cancelled_rooms:
                await asyncio.sleep(0.02)
        d.hold.set()
        response = await answer
    assert response.status_code == 200 and "d0-tok2" in response.text


async def test_a_prefill_refusing_the_routers_key_answers_at_once(
    engines, kv_table, start_router, client
):
    """No work was done, so no KV will come: the router does not wait for the decode engine
    to give up on the room (5 s in the fake, --disaggregation-timeout in an engine)."""
    p = await engines("p0", "prefill", kv=kv_table, api_key="key")
    d = await engines("d0", "decode", kv=kv_table, tokens=3)
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        started = time.monotonic()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        elapsed = time.monotonic() - started
    assert response.status_code == 502 and "refused the router's credentials" in response.text
    assert elapsed < 2.0


async def test_a_decode_engine_that_refuses_the_request_answers_even_if_its_prefill_fails_first(
    engines, kv_table, start_router, client
):
    """The decode engine refuses a request (a 400) and cancels its room; the prefill engine,
    told so, may answer its 502 first. The client's answer is the decode engine's 400."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status = 502
    d.fail_status, d.fail_after_s = 400, 0.2
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "d0 fails on purpose"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_that_fails_after_sending_the_kv_leaves_the_decode_answer_whole(
    stream, engines, kv_table, start_router, client
):
    """The prefill engine answers 500 once the KV cache is sent: the decode engine had it,
    so its answer is the client's (not the prefill's 500), and both
    requests end, counted out of flight."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_after_kv = 500
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": stream}
        )
        assert response.status_code == 200
        assert "d0-tok2" in response.text and "error" not in response.text
        async with asyncio.timeout(2):
            await out_of_flight(router)


async def test_a_prefill_that_dies_while_decode_holds_its_answer_leaves_it_whole(
    engines, kv_table, start_router, client, caplog
):
    """Not streamed, the router cannot see the decode engine's progress: the decode engine's
    answer decides (it fails by itself when the KV never comes); here it had the KV."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()  # the KV is sent, the answer held
    d.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        answer = asyncio.ensure_future(
            client.post(router.url + "/v1/completions", json={"prompt": "x"})
        )
        await p.wait_for_requests(1)
        await d.wait_for_requests(1)
        await p.kill()
        await asyncio.sleep(0.1)  # the router has seen the prefill's connection break
        d.hold.set()
        response = await answer
    assert response.status_code == 200 and "d0-tok2" in response.json()["choices"][0]["text"]
    assert "prefill failed after its decode engine had the KV cache" in caplog.text


async def test_a_decode_stream_that_breaks_closes_the_prefill_request(
    engines, kv_table, start_router, client
):
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()  # the prefill sends the KV cache, then holds its answer
    d.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        body = {"prompt": "x", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            lines = (line async for line in response.aiter_lines() if line)
            assert "d0-tok0" in await anext(lines)
            await d.kill()
            async with asyncio.timeout(5):
                rest = [line async for line in lines]
        assert "broke off the stream" in rest[-2] and rest[-1] == "data: [DONE]"
        async with asyncio.timeout(2):  # the prefill's request is closed, not left to run on
            await p.client_gone.wait()
            await out_of_flight(router)
    # one answer, a 200 stream its decode worker broke off, counted once
    metrics = router.app.metrics.registry.get_sample_value
    assert metrics("kubesgl_router_responses_total", {"status": "200"}) == 1
    assert metrics("kubesgl_router_broken_streams_total", {"reason": "worker"}) == 1


async def test_a_prefill_that_refuses_before_working_is_retried_at_once(
    engines, kv_table, start_router, client
):
    prefills, (d,) = await pd_pool(engines, kv_table, prefills=2)
    prefills[0].fail_status = 503  # overloaded: retryable, and its decode engine hears nothing
    config = pd_config(prefills, [d], policy="round_robin", breaker_failure_threshold=100)
    async with start_router(**config) as router:
        await router.ready()
        for _ in range(2):
            started = time.monotonic()
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
            assert time.monotonic() - started < 0.5  # no wait for a decode verdict


async def test_decode_error_names_the_decode_worker(engines, kv_table, start_router, client):
    (p,), (d,) = await pd_pool(engines, kv_table)
    d.fail_status = 503
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=100)) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": True}
        )
    assert response.status_code == 503
    assert response.json()["error"]["message"].startswith(f"decode worker {d.url} answered 503")


async def test_dead_prefill_is_retried_on_another(engines, kv_table, start_router, client):
    (p0, p1), (d,) = await pd_pool(engines, kv_table, prefills=2)
    async with start_router(**pd_config([p0, p1], [d], policy="round_robin")) as router:
        await router.all_healthy()
        await p0.kill()
        for _ in range(3):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
    assert len(p1.requests) == 3


def _counts(router) -> dict[tuple[str, str], float]:
    """The router's attempts by (worker, status), those that happened."""
    return {
        (sample.labels["worker"], sample.labels["status"]): sample.value
        for family in router.app.metrics.registry.collect()
        if family.name == "kubesgl_router_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value and sample.labels["worker"]
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_prefill_is_blamed_and_its_request_served_by_another_pair(
    stream, engines, kv_table, start_router, client
):
    """A prefill engine hangs (SIGSTOP): it never answers the request, and the decode engine's
    post of the room to its bootstrap server times out (502 "could not be reached ...
    ReadTimeout"). The decode engine answered an error before any output (a stream too: its
    error comes before the first chunk), so the router retries the request on another pair
    without that prefill worker, whose failure it was: its attempt counts as `error` in its
    breaker, the decode's, which passed the failure on, as `cancelled`. The client got a 502,
    no worker blamed, and both attempts counted `cancelled`."""
    (hung, p1), (d,) = await pd_pool(engines, kv_table, prefills=2)
    hung.hung_post_timeout_s = 0.2
    config = pd_config([hung, p1], [d], policy="round_robin", breaker_failure_threshold=100)
    async with start_router(**config) as router:
        await router.all_healthy()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": stream}
        )
        assert response.status_code == 200, response.text
        assert "d0-tok2" in response.text
        async with asyncio.timeout(2):
            await hung.client_gone.wait()  # its request is closed
            await out_of_flight(router)
        prefill = router.app.workers.get(hung.url)
        assert prefill.breaker.consecutive_failures == 1
        assert router.app.workers.get(d.url).breaker.consecutive_failures == 0
        counts = _counts(router)
    assert len(hung.requests) == len(p1.requests) == 1 and len(d.requests) == 2
    assert p1.requests[0]["body"]["bootstrap_room"] != hung.requests[0]["body"]["bootstrap_room"]
    assert counts == {
        (hung.url, "error"): 1,
        (d.url, "cancelled"): 1,
        (d.url, "200"): 1,
        (p1.url, "200"): 1,
    }
    assert router.app.metrics.registry.get_sample_value("kubesgl_router_retries_total") == 1


async def test_a_hung_prefill_without_retries_left_answers_the_decodes_error_counted_once(
    engines, kv_table, start_router, client
):
    """No retry left (--max-retries 0): the client gets the decode engine's 502, which names
    the prefill engine, and the failure is counted once, in a 5xx-or-error series (the
    server-error alert's): the hung prefill worker's `error`; the decode's attempt, which only
    passed it on, `cancelled`."""
    (hung,), (d,) = await pd_pool(engines, kv_table)
    hung.hung_post_timeout_s = 0.2
    config = pd_config([hung], [d], retry=RetrySettings(max_retries=0))
    async with start_router(**config) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        async with asyncio.timeout(2):
            await out_of_flight(router)
        counts = _counts(router)
        prefill = router.app.workers.get(hung.url)
        assert prefill.breaker.consecutive_failures == 1
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message.startswith(f"decode worker {d.url} answered 502: ")
    assert "could not be reached" in message and "ReadTimeout" in message
    assert f"prefill worker {hung.url} had not answered" in message
    assert counts == {(hung.url, "error"): 1, (d.url, "cancelled"): 1}


async def test_a_decode_error_the_prefill_does_not_explain_is_counted_by_its_status(
    engines, kv_table, start_router, client
):
    """The prefill request answered 200 and the decode engine answers 502 for the room (its
    KV note lost, say): the router cannot tell whose failure it was and blames neither, but
    the client's 502 is counted by its status on the decode worker, not as `cancelled`, in no
    5xx series."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    d.fail_status, d.fail_after_s = 502, 0.1
    async with start_router(**pd_config([p], [d], breaker_failure_threshold=1)) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        async with asyncio.timeout(2):
            await out_of_flight(router)
        counts = _counts(router)
        assert router.app.workers.get(d.url).breaker.consecutive_failures == 0
    assert response.status_code == 502
    assert counts == {(p.url, "200"): 1, (d.url, "502"): 1}


async def test_a_prefill_dying_mid_stream_leaves_the_decode_stream_whole(
    engines, kv_table, start_router, client
):
    """The decode engine streams (it had the KV): the prefill's death does not touch the
    answer, which the prefill's error does not end."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()  # the prefill sends the KV cache, then never answers
    d.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        body = {"prompt": "x", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            lines = (line async for line in response.aiter_lines() if line)
            assert "d0-tok0" in await anext(lines)
            await p.kill()
            await asyncio.sleep(0.1)  # the router has seen the prefill's connection break
            d.hold.set()
            async with asyncio.timeout(5):
                rest = [line async for line in lines]
    assert "d0-tok2" in rest[-2] and rest[-1] == "data: [DONE]"
    assert not d.client_gone.is_set()


async def test_batched_requests_get_one_room_per_choice(engines, kv_table, start_router, client):
    (p,), (d,) = await pd_pool(engines, kv_table)
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        several = await client.post(
            router.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 2}
        )
        single = await client.post(router.url + "/v1/completions", json={"prompt": "a"})
    assert several.status_code == 200 and single.status_code == 200
    rooms = [r["body"]["bootstrap_room"] for r in p.requests]
    assert [r["body"]["bootstrap_room"] for r in d.requests] == rooms
    assert isinstance(rooms[0], list) and len(set(rooms[0])) == 4  # prompts x n, each new
    assert isinstance(rooms[1], int) and rooms[1] not in rooms[0]


async def test_without_a_prefill_worker_the_decode_pool_serves_and_the_router_stays_ready(
    engines, kv_table, start_router, client
):
    """A trial's only prefill engine died: once it failed its health checks, the router refused
    every request, and its /health went 503 (a Kubernetes router pod out of Ready), while the
    decode engine, which prefills a request without a bootstrap room itself, was healthy."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    config = pd_config([p], [d], disaggregation=DisaggregationSettings())  # the defaults
    async with start_router(**config) as router:
        await router.ready()
        p.healthy = False
        await router.until(lambda: router.app.degraded() is not None, timeout=5)
        health = await client.get(router.url + "/health")
        long_prompt = {"prompt": "word " * 400}  # ~500 tokens: handed over if P could take it
        served = await client.post(router.url + "/v1/completions", json=long_prompt)
        metrics = (await client.get(router.url + "/metrics")).text
        d.healthy = False
        await router.until(lambda: not router.app.can_serve(), timeout=5)
        unready = await client.get(router.url + "/health")
        refused = await client.post(router.url + "/v1/completions", json=long_prompt)
        liveness = await client.get(router.url + "/liveness")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["message"].startswith(
        "no prefill worker can serve: 1 registered, 1 failing"
    )
    assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith("d0")
    assert not p.requests and "bootstrap_room" not in d.requests[0]["body"]
    assert pd_route_counts(metrics)["decode_only_no_prefill"] == 1
    assert liveness.status_code == 200  # the decode pool down too: unready, not broken
    for answer in (unready, refused):  # /health says which role it lacks (kubesgl up prints it)
        assert (
            answer.status_code == 503
            and "no decode worker can serve" in answer.json()["error"]["message"]
        )


async def test_short_uncached_prompts_go_to_a_decode_worker_alone(
    engines, kv_table, start_router, client
):
    (p,), (d,) = await pd_pool(engines, kv_table)
    settings = DisaggregationSettings(min_prefill_tokens=8)
    async with start_router(
        **pd_config([p], [d], policy="cache_aware", disaggregation=settings)
    ) as router:
        await router.ready()
        short = await client.post(
            router.url + "/v1/completions", json={"prompt": "a short one"}
        )  # ~3 tokens
        ids = await client.post(router.url + "/v1/completions", json={"prompt": list(range(1, 40))})
        metrics = (await client.get(router.url + "/metrics")).text
    assert short.status_code == 200 and ids.status_code == 200
    assert len(p.requests) == 1 and p.requests[0]["body"]["prompt"] == list(range(1, 40))
    assert (
        "bootstrap_room" not in d.requests[0]["body"] and "bootstrap_room" in d.requests[1]["body"]
    )
    assert 'kubesgl_router_pd_routes_total{route="decode_only_short"} 1.0' in metrics
    assert 'kubesgl_router_pd_routes_total{route="disaggregated"} 1.0' in metrics


async def test_a_saturated_prefill_pool_sends_new_requests_to_a_decode_worker_alone(
    engines, kv_table, start_router, client
):
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()  # the prefill worker keeps its first request
    settings = DisaggregationSettings(min_prefill_tokens=0, max_prefill_in_flight=1)
    async with start_router(**pd_config([p], [d], disaggregation=settings)) as router:
        await router.ready()
        first = asyncio.ensure_future(
            client.post(router.url + "/v1/completions", json={"prompt": "one"})
        )
        await p.wait_for_requests(1)
        second = await client.post(router.url + "/v1/completions", json={"prompt": "two"})
        p.hold.set()
        assert (await first).status_code == 200
    assert second.status_code == 200 and len(p.requests) == 1
    assert "bootstrap_room" not in d.requests[-1]["body"]


async def test_a_complete_decode_stream_lets_a_slow_prefill_answer_finish(
    engines, kv_table, start_router, client
):
    """The decode stream ends before the prefill engine's answer (it sent the KV cache, then
    held its answer): the prefill request runs to its end and is counted as a 200, not
    cancelled when the client's stream is closed."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        response = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": True}
        )
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        await asyncio.sleep(0.1)  # the router has closed the client's stream
        p.hold.set()
        async with asyncio.timeout(2):
            await out_of_flight(router)
        assert not p.client_gone.is_set()
        metrics = (await client.get(router.url + "/metrics")).text
    prefill_outcomes = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kubesgl_router_requests"
        for sample in family.samples
        if sample.labels.get("worker") == p.url and sample.name.endswith("_total")
    }
    assert prefill_outcomes == {"200": 1, "error": 0, "cancelled": 0}


async def test_a_prompt_cached_only_at_the_prefill_pool_is_still_disaggregated(
    engines, kv_table, start_router, client
):
    """A long prompt the prefill pool has cached but no decode worker has: sent to a decode
    worker alone, that worker would prefill all of it. What counts is what the decode worker
    would have to prefill, which the decode policy knows (round robin keeps no trees: all)."""
    (p,), decodes = await pd_pool(engines, kv_table, decodes=2)
    settings = DisaggregationSettings(min_prefill_tokens=8)
    config = pd_config([p], decodes, decode_policy="round_robin", disaggregation=settings)
    async with start_router(policy="cache_aware", **config) as router:
        await router.ready()
        for prompt in (list(range(1, 40)), list(range(1, 41))):
            answer = await client.post(router.url + "/v1/completions", json={"prompt": prompt})
            assert answer.status_code == 200
    assert [r["body"]["prompt"] for r in p.requests] == [list(range(1, 40)), list(range(1, 41))]


async def test_a_client_that_leaves_mid_stream_lets_the_finished_prefill_end_well(
    engines, kv_table, start_router, client
):
    """The decode engine streams (it has the KV: the prefill's part is done) and the client
    leaves before the prefill engine's answer came: the prefill request ends on its own, a
    200, not aborted (CI's live-Prometheus test saw the prefill engine count an abort)."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()  # the KV is sent, the answer held
    d.hold = asyncio.Event()  # the decode stream pauses after its first chunk
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        body = {"prompt": "x", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break  # the first chunk: leave
        async with asyncio.timeout(2):
            await d.client_gone.wait()
        p.hold.set()
        async with asyncio.timeout(2):
            await out_of_flight(router)
        metrics = (await client.get(router.url + "/metrics")).text
    prefill_outcomes = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kubesgl_router_requests"
        for sample in family.samples
        if sample.labels.get("worker") == p.url and sample.name.endswith("_total")
    }
    assert prefill_outcomes == {"200": 1, "error": 0, "cancelled": 0} and not p.client_gone.is_set()


@pytest.mark.parametrize("field", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
async def test_a_client_cannot_set_the_bootstrap_fields(
    field, engines, kv_table, start_router, client
):
    """They tell a decode engine which prefill engine to fetch the KV from: one a client could
    set would make the decode engine connect where the client says (a short prompt went to it
    unchanged)."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    settings = DisaggregationSettings(min_prefill_tokens=8)
    values = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8293, "bootstrap_room": 12345}
    async with start_router(**pd_config([p], [d], disaggregation=settings)) as router:
        await router.ready()
        answers = [
            await client.post(router.url + "/v1/completions", json={"prompt": prompt, field: v})
            for prompt, v in (("short", values[field]), (list(range(1, 40)), values[field]))
        ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == field
        assert "set by the router" in answer.json()["error"]["message"]
    assert not p.requests and not d.requests


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_before_the_kv_arrived_closes_the_prefill_request(
    stream, engines, kv_table, start_router, client
):
    """The client leaves while the prefill engine still works (it has sent no KV, so the
    decode engine has not answered): the router closes both engines' requests, which aborts
    them there, and counts both cancelled, not the prefill's answer."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status, p.fail_after_s = 500, 30.0  # still prefilling when the client leaves
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        body = {"prompt": "x", "stream": stream}
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await client.post(router.url + "/v1/completions", json=body)
        async with asyncio.timeout(2):
            await p.client_gone.wait()
            await d.client_gone.wait()
            await out_of_flight(router)
        metrics = (await client.get(router.url + "/metrics")).text
    outcomes = {
        (sample.labels["worker"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kubesgl_router_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value
    }
    assert outcomes == {(p.url, "cancelled"): 1, (d.url, "cancelled"): 1}


def pd_route_counts(metrics: str) -> dict[str, float]:
    return {
        sample.labels["route"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kubesgl_router_pd_routes"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


@pytest.mark.parametrize("min_prefill_tokens", [0, 1000], ids=["disaggregated", "decode_only"])
async def test_a_request_the_engines_refuse_is_no_pd_route(
    min_prefill_tokens, engines, kv_table, start_router, client
):
    """A request the engines refuse (a 400 from each) was never served prefill/decode: it
    counted as a route of kubesgl_router_pd_routes_total all the same."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.fail_status = d.fail_status = 400  # as engines answer a request they do not take
    settings = DisaggregationSettings(min_prefill_tokens=min_prefill_tokens)
    async with start_router(**pd_config([p], [d], disaggregation=settings)) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/chat/completions", json=BODY)
        metrics = (await client.get(router.url + "/metrics")).text
    assert response.status_code == 400 and d.requests
    assert set(pd_route_counts(metrics).values()) == {0}


async def test_a_pd_request_goes_to_a_pair_of_its_model(engines, kv_table, start_router, client):
    """Two pairs of two served names (a rename rolling out): prefill and decode workers are both
    chosen among those of the request's model, not by the policy alone."""
    pairs = {
        model: (
            await engines(f"p-{model}", "prefill", kv=kv_table, model=model),
            await engines(f"d-{model}", "decode", kv=kv_table, model=model),
        )
        for model in ("old-name", "new-name")
    }
    prefills, decodes = zip(*pairs.values())
    config = pd_config(prefills, decodes, policy="round_robin")
    async with start_router(**config) as router:
        await router.all_healthy()
        for model in ("new-name", "old-name") * 2:
            response = await client.post(
                router.url + "/v1/chat/completions", json={**BODY, "model": model}
            )
            assert response.status_code == 200, response.text
        unknown = await client.post(
            router.url + "/v1/chat/completions", json={**BODY, "model": "gone-name"}
        )
    for model, pair in pairs.items():
        assert [r["body"]["model"] for e in pair for r in e.requests] == [model] * 4
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


async def test_the_models_list_names_the_models_of_every_decode_worker(
    engines, kv_table, start_router, client
):
    """Two pairs of two served names: the decode workers answer GET /v1/models, one of each
    name, and the list names both (it named one worker's)."""
    pairs = [
        (
            await engines(f"p-{model}", "prefill", kv=kv_table, model=model),
            await engines(f"d-{model}", "decode", kv=kv_table, model=model),
        )
        for model in ("old-name", "new-name")
    ]
    prefills, decodes = zip(*pairs)
    async with start_router(**pd_config(prefills, decodes)) as router:
        await router.all_healthy()
        listing = await client.get(router.url + "/v1/models")
    assert [c["id"] for c in listing.json()["data"]] == ["old-name", "new-name"]
    assert [e.models_listed for e in (*prefills, *decodes)] == [0, 0, 1, 1]


async def test_a_request_retried_on_another_pair_is_one_pd_route(
    engines, kv_table, start_router, client
):
    """A decode worker that refuses before any work (503) sends the request to another pair:
    one request, one route (each attempt counted one)."""
    (p,), decodes = await pd_pool(engines, kv_table, decodes=2)
    decodes[0].fail_status = 503
    config = pd_config([p], decodes, decode_policy="round_robin")
    async with start_router(**config) as router:
        await router.ready()
        for _ in range(2):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
        metrics = (await client.get(router.url + "/metrics")).text
    assert decodes[0].requests  # one of the two was retried
    assert pd_route_counts(metrics) == {
        "disaggregated": 2,
        "decode_only_short": 0,
        "decode_only_saturated": 0,
        "decode_only_no_prefill": 0,
        "decode_only_incompatible": 0,
    }


async def test_tokenize_goes_to_one_worker_and_is_no_pd_route(
    engines, kv_table, start_router, client
):
    """Either role's engine has the model's tokenizer: /tokenize needs no pair, nor a room."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        tokens = await client.post(router.url + "/tokenize", json={"prompt": "hi"})
        metrics = (await client.get(router.url + "/metrics")).text
    assert tokens.status_code == 200 and tokens.json()["tokens"] == [104, 105]
    assert not p.requests and [r["body"] for r in d.requests] == [{"prompt": "hi"}]
    assert set(pd_route_counts(metrics).values()) == {0}


def _outcomes(router, worker_url: str) -> dict[str, float]:
    """The router's attempts on one worker, by status (read from its registry, which outlives
    its HTTP server)."""
    return {
        sample.labels["status"]: sample.value
        for family in router.app.metrics.registry.collect()
        if family.name == "kubesgl_router_requests"
        for sample in family.samples
        if sample.labels.get("worker") == worker_url and sample.name.endswith("_total")
    }


@pytest.mark.parametrize("prefill_answers_in_time", [True, False])
async def test_a_router_shutting_down_ends_the_prefill_drains_it_let_run_without_blaming_them(
    prefill_answers_in_time, engines, kv_table, start_router, client, monkeypatch, caplog
):
    """The client has its answer; the prefill engine holds its own (the KV is sent). A router
    that shuts down (a rolling update) waits a little for that answer, then cancels the
    drain: not a broken connection (the session closed under it), counted as a failure of a
    healthy prefill worker (its breaker, its metrics, out of the pool), nor a task destroyed
    while pending."""
    monkeypatch.setattr("kubesgl.router.pd.DRAIN_GRACE_AT_SHUTDOWN_S", 0.5)
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.hold = asyncio.Event()
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 200
        await p.wait_for_requests(1)
        if prefill_answers_in_time:  # once the router's shutdown has begun
            shutdown = router.app.shutdown

            async def answer_then_shut_down() -> None:
                asyncio.get_running_loop().call_later(0.1, p.hold.set)
                await shutdown()

            router.app.shutdown = answer_then_shut_down  # type: ignore[method-assign]
    (prefill,) = [worker for worker in router.app.workers.all() if worker.url == p.url]
    assert prefill.in_flight == 0
    assert prefill.breaker.consecutive_failures == 0
    assert "prefill failed" not in caplog.text
    assert not router.app._forwarder.pd._background
    if prefill_answers_in_time:
        assert _outcomes(router, p.url) == {"200": 1, "error": 0, "cancelled": 0}
    else:
        assert _outcomes(router, p.url) == {"200": 0, "error": 0, "cancelled": 1}
        async with asyncio.timeout(2):
            await p.client_gone.wait()  # the engine saw its request end


async def test_a_pair_without_a_free_connection_is_refused_by_the_router(
    engines, kv_table, start_router, client
):
    """Streams hold all connections of --max-connections but one: the next pair, whose prefill
    and decode requests need two, finds too few, and the router refuses the request itself
    (503, Retry-After): no worker is blamed, no route counted, nothing sent."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    d.hold = asyncio.Event()  # decode streams pause after their first chunk
    config = pd_config([p], [d], max_connections=3, connect_timeout_s=0.3)

    async def stream() -> None:
        body = {**BODY, "stream": True}
        async with client.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass

    async with start_router(**config) as router:
        await router.ready()
        held = [asyncio.create_task(stream()) for _ in range(2)]
        decode = router.app.workers.get(d.url)
        prefill = router.app.workers.get(p.url)
        await router.until(
            lambda: decode.in_flight == 2 and prefill.in_flight == 0 and len(d.requests) == 2
        )
        sent = len(p.requests), len(d.requests)
        refused = await client.post(router.url + "/v1/chat/completions", json=BODY)
        assert (len(p.requests), len(d.requests)) == sent
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "connection_limit"
        for worker in (prefill, decode):
            assert worker.breaker.consecutive_failures == 0 and worker.healthy
        d.hold.set()
        await asyncio.gather(*held)
        metrics = (await client.get(router.url + "/metrics")).text
    assert 'kubesgl_router_pd_routes_total{route="disaggregated"} 2.0' in metrics
    assert 'kubesgl_router_rejections_total{reason="connection_limit",status="503"} 1.0' in metrics


async def test_a_pair_sends_nothing_until_it_has_both_connections(
    engines, kv_table, start_router, client
):
    """One connection of --max-connections is free: a pair took it for its prefill request,
    which a prefill engine holds until its decode engine asks for the room, and waited for
    a second for its decode request, till the router refused it: the prefill engine had the
    request for nothing (and pairs each holding one connection could wait on each other). A
    pair takes its two at once, or sends nothing."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    d.hold = asyncio.Event()  # decode streams pause after their first chunk
    p.room_wait_s = 5.0
    config = pd_config([p], [d], max_connections=2, connect_timeout_s=0.3)
    async with start_router(**config) as router:
        await router.ready()
        body = {**BODY, "stream": True}
        held = asyncio.create_task(client.post(router.url + "/v1/chat/completions", json=body))
        decode = router.app.workers.get(d.url)
        await router.until(lambda: decode.in_flight == 1 and not p.requests[1:])
        await router.until(lambda: router.app.workers.get(p.url).in_flight == 0)
        refused = await client.post(router.url + "/v1/chat/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "connection_limit"
        assert len(p.requests) == len(d.requests) == 1  # the held stream's only
        d.hold.set()
        assert (await held).status_code == 200
        # with the stream's connection back, a burst of pairs at the limit is served
        d.hold = None
        answers = await asyncio.gather(
            *(client.post(router.url + "/v1/chat/completions", json=BODY) for _ in range(3))
        )
        await out_of_flight(router)
    assert [a.status_code for a in answers] == [200] * 3


OLD_LAYOUT, NEW_LAYOUT = "kv1-00000000000000aa", "kv1-00000000000000bb"


async def test_a_rollout_of_another_kv_layout_pairs_each_decode_with_a_prefill_of_its_layout(
    engines, kv_table, start_router, client
):
    """Half a rollout of another tensor-parallel size: old and new prefill and decode engines,
    each naming its KV layout in its /health. A prefill engine refuses a decode engine of
    another layout (a 502): the router pairs old with old and new with new only."""
    prefills, decodes = await pd_pool(engines, kv_table, prefills=2, decodes=2)
    # crossed: the two round-robin policies alone would pair each decode with the other layout
    layouts = (OLD_LAYOUT, NEW_LAYOUT, NEW_LAYOUT, OLD_LAYOUT)
    for engine, layout in zip((*prefills, *decodes), layouts):
        engine.kv_layout = layout
    config = pd_config(prefills, decodes, policy="round_robin")
    async with start_router(**config) as router:
        await router.ready()
        for i in range(8):
            response = await client.post(router.url + "/generate", json={"text": f"q{i}"})
            assert response.status_code == 200
        listed = (await client.get(router.url + "/workers")).json()["workers"]
    for p, d in zip(prefills, reversed(decodes)):
        rooms = {r["body"]["bootstrap_room"] for r in p.requests}
        assert rooms == {r["body"]["bootstrap_room"] for r in d.requests} and len(rooms) == 4
    assert {w["url"]: w["kv_layout"] for w in listed} == {
        e.url: e.kv_layout for e in (*prefills, *decodes)
    }


async def test_a_decode_worker_with_no_prefill_of_its_layout_serves_alone_and_unknown_pairs_any(
    engines, kv_table, start_router, client
):
    """The new decode engine is up, the new prefill engine not yet: the new decode worker
    prefills its requests itself. An engine that names no layout (SGLang's) pairs with any."""
    (p,), (d_old, d_new, d_unknown) = await pd_pool(engines, kv_table, decodes=3)
    p.kv_layout, d_old.kv_layout, d_new.kv_layout = OLD_LAYOUT, OLD_LAYOUT, NEW_LAYOUT
    config = pd_config([p], [d_old, d_new, d_unknown], policy="round_robin")
    async with start_router(**config) as router:
        await router.ready()
        for i in range(6):
            response = await client.post(router.url + "/generate", json={"text": f"q{i}"})
            assert response.status_code == 200
        metrics = (await client.get(router.url + "/metrics")).text
    assert len(d_new.requests) == 2
    assert not any("bootstrap_room" in r["body"] for r in d_new.requests)
    for d in (d_old, d_unknown):
        assert len(d.requests) == 2 and all("bootstrap_room" in r["body"] for r in d.requests)
    assert len(p.requests) == 4
    assert pd_route_counts(metrics)["decode_only_incompatible"] == 2
    assert pd_route_counts(metrics)["disaggregated"] == 4


async def test_a_prefill_engine_restarted_in_the_new_layout_pairs_with_the_new_decode_engine(
    engines, kv_table, start_router, client
):
    """The health checks keep each worker's layout current: the prefill engine restarts (its
    /health names the new layout), and the new decode engine's requests are handed over."""
    (p,), (d,) = await pd_pool(engines, kv_table)
    p.kv_layout, d.kv_layout = OLD_LAYOUT, NEW_LAYOUT
    async with start_router(**pd_config([p], [d])) as router:
        await router.ready()
        alone = await client.post(router.url + "/generate", json={"text": "q0"})
        p.kv_layout = NEW_LAYOUT
        [prefill] = router.app.workers.with_role(Role.PREFILL)
        await router.until(lambda: prefill.kv_layout == NEW_LAYOUT)
        paired = await client.post(router.url + "/generate", json={"text": "q1"})
    assert alone.status_code == paired.status_code == 200
    assert [("bootstrap_room" in r["body"]) for r in d.requests] == [False, True]
    assert len(p.requests) == 1
