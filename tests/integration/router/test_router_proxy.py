"""The router in mixed mode in front of fake engines: the engine's HTTP surface, unchanged."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from router_fakes import STOP_REASON

from kubesgl.router.health import HealthSettings

pytestmark = pytest.mark.asyncio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_non_streaming_chat_is_answered_by_a_worker(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"].startswith("a-tok0")
    assert a.requests[0]["body"] == CHAT
    assert len(response.headers.get_list("date")) == 1  # the router's, not also the worker's


async def test_a_request_at_once_after_start_up_is_served(engines, start_router, client):
    """The router answered 503 "1 failing health checks" until its first check of ready
    engines had run: `kubesgl up`'s first request, and any after a router restart."""
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:  # no wait for readiness
        response = await client.post(router.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


async def test_each_workers_model_is_named_in_its_info_series(engines, start_router, client):
    """The router asks a worker's /v1/models before it joins the pool: kubesgl_router_worker_info
    then names the model (model_name, as on the engines' series) and GET /workers shows it."""
    a = await engines("a")
    async with start_router(workers=[a.url], admin_api_key="k") as router:
        await router.ready()
        metrics = (await client.get(router.url + "/metrics")).text
        listing = (
            await client.get(router.url + "/workers", headers={"Authorization": "Bearer k"})
        ).json()
    assert (
        f'kubesgl_router_worker_info{{model_name="fake-model",role="mixed",worker="{a.url}",worker_pod=""}} 1.0'
        in metrics
    ), metrics
    assert [w["model_name"] for w in listing["workers"]] == ["fake-model"]


async def test_requests_go_only_to_workers_of_their_model(engines, start_router, client):
    """Workers of two served names behind one router (a rename rolling out): a request for one
    went to either worker by the policy alone, and the other's engine answered 404."""
    old, new = await engines("old", model="old-name"), await engines("new", model="new-name")
    async with start_router(workers=[old.url, new.url], policy="round_robin") as router:
        await router.all_healthy()
        for model, engine in (("new-name", new), ("old-name", old)):
            for _ in range(3):
                body = {**CHAT, "model": model}
                response = await client.post(router.url + "/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
            card = await client.get(router.url + "/v1/models/" + model)
            tokens = await client.post(
                router.url + "/tokenize", json={"model": model, "prompt": "x"}
            )
            assert card.json()["id"] == model and tokens.status_code == 200
            assert {r["body"].get("model") for r in engine.requests} == {model}
        unnamed = [
            await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            for _ in range(2)
        ]
        unknown = await client.post(
            router.url + "/v1/chat/completions", json={**CHAT, "model": "gone-name"}
        )
        metrics = (await client.get(router.url + "/metrics")).text
    assert [r.status_code for r in unnamed] == [200, 200]  # a request without a model: any worker
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "the model 'gone-name' does not exist; the workers serve 'new-name', 'old-name'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert not [r for e in (old, new) for r in e.requests if r["body"].get("model") == "gone-name"]
    assert 'kubesgl_router_rejections_total{reason="not_found",status="404"} 1.0' in metrics


async def test_a_worker_serves_every_name_its_models_list(engines, start_router, client):
    """A worker whose /v1/models lists several ids (vLLM's --served-model-name a b) serves each:
    the router knew only the first and answered 404 for the others."""
    a = await engines("a", model="name", aliases=("alias",))
    async with start_router(workers=[a.url]) as router:
        await router.all_healthy()
        answers = [
            await client.post(router.url + "/v1/chat/completions", json={**CHAT, "model": model})
            for model in ("name", "alias", "other")
        ]
    assert [r.status_code for r in answers] == [200, 200, 404]
    assert "the workers serve 'alias', 'name'" in answers[2].json()["error"]["message"]


async def test_the_models_list_names_every_model_the_workers_serve(engines, start_router, client):
    """Workers of two sets of served names behind one router (a rename rolling out): GET
    /v1/models was one worker's answer, and listed its names alone. One worker of each set
    answers now, and the cards are merged by id, the first card of an id kept."""
    old = await engines("old", model="old-name", aliases=("shared",))
    new = await engines("new", model="new-name", aliases=("shared",))
    twin = await engines("twin", model="new-name", aliases=("shared",))
    async with start_router(workers=[old.url, new.url, twin.url]) as router:
        await router.all_healthy()
        listing = await client.get(router.url + "/v1/models")
    assert listing.status_code == 200, listing.text
    assert listing.json()["object"] == "list"
    cards = listing.json()["data"]
    assert [c["id"] for c in cards] == ["old-name", "shared", "new-name"]
    assert cards[1]["owned_by"] == "old"
    assert (old.models_listed, new.models_listed + twin.models_listed) == (1, 1)


async def test_workers_of_one_set_of_names_list_their_models_as_before(
    engines, start_router, client
):
    """One set of served names: one worker's answer, as the engine gave it."""
    a, b = await engines("a"), await engines("b")
    async with start_router(workers=[a.url, b.url]) as router:
        await router.all_healthy()
        listing = await client.get(router.url + "/v1/models")
    assert listing.json() == {
        "object": "list",
        "data": [{"id": "fake-model", "object": "model", "owned_by": "a"}],
    }
    assert (a.models_listed, b.models_listed) == (1, 0)


async def test_the_models_list_leaves_out_the_models_of_workers_that_fail(
    engines, start_router, client, caplog
):
    """While the workers of one name fail to list it (after retries, for a 503), the list names
    the others' models, and the router warns of what it left out once: the list was that first
    worker's error. Only when no worker lists its models is the list an error, the first set's."""
    old, new = await engines("old", model="old-name"), await engines("new", model="new-name")
    async with start_router(workers=[old.url, new.url], breaker_failure_threshold=100) as router:
        await router.all_healthy()
        for status in (500, 503):
            old.models_status = status
            listing = await client.get(router.url + "/v1/models")
            assert listing.status_code == 200, listing.text
            assert [c["id"] for c in listing.json()["data"]] == ["new-name"]
        old.models_status = new.models_status = 500
        failed = await client.get(router.url + "/v1/models")
    assert old.models_listed == 1 + 4 + 1  # the 500 once, the 503 retried 3 times, the 500 again
    assert failed.status_code == 500 and old.url in failed.json()["error"]["message"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # once, when they started failing: not at each listing (a UI polls the list)
    left_out = [w for w in warnings if "the workers serving 'old-name' gave no model list" in w]
    assert len(left_out) == 1, warnings


async def test_a_worker_back_in_the_pool_is_asked_its_model_again(engines, start_router, client):
    """An engine restarted at its address with another served name kept its old name in the
    router, which would now refuse requests for the new one (404) and send it the old one's."""
    a = await engines("a", model="old-name")
    async with start_router(workers=[a.url]) as router:
        await router.all_healthy()
        await a.kill()
        worker = router.app.workers.all()[0]
        await router.until(lambda: not worker.healthy)
        a.model = "new-name"
        await a.restart()
        await router.all_healthy()
        response = await client.post(
            router.url + "/v1/chat/completions", json={**CHAT, "model": "new-name"}
        )
    assert worker.model_name == "new-name" and response.status_code == 200, response.text


async def test_each_generation_route_is_forwarded(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        completion = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        generate = await client.post(router.url + "/generate", json={"text": "x"})
        models = await client.get(router.url + "/v1/models")
        model = await client.get(router.url + "/v1/models/fake-model")
        other = await client.get(router.url + "/v1/models/other-model")
    assert completion.json()["choices"][0]["text"].startswith("a-tok0")
    assert generate.json()["text"].startswith("a-tok0")
    # the answer as the worker gave it, vLLM's stop_reason and SGLang's matched included
    assert completion.json()["choices"][0]["stop_reason"] == STOP_REASON
    assert generate.json()["meta_info"]["finish_reason"]["matched"] == STOP_REASON
    assert models.json()["data"][0]["id"] == "fake-model"
    assert model.status_code == 200 and model.json()["id"] == "fake-model"
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert [r["path"] for r in a.requests] == ["/v1/completions", "/generate"]


async def test_tokenize_detokenize_and_version_are_a_workers_answers(engines, start_router, client):
    """vLLM's routes, served by an engine, through the router too: every worker of the pool has
    the model's tokenizer, so the least loaded one answers, as for /v1/models."""
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        tokens = await client.post(router.url + "/tokenize", json={"prompt": "hi"})
        text = await client.post(router.url + "/detokenize", json={"tokens": [104, 105]})
        version = await client.get(router.url + "/version")
    assert tokens.json() == {"count": 2, "max_model_len": 4096, "tokens": [104, 105]}
    assert text.json() == {"prompt": "hi"} and version.json() == {"version": "a-version"}
    assert [r["path"] for r in a.requests] == ["/tokenize", "/detokenize"]


async def test_a_model_name_cannot_reach_another_engine_route(engines, start_router, client):
    """The name is forwarded as one encoded segment: dot segments and a query in it would
    otherwise take the request, with the router's engine key, to any of the engine's GET
    routes (/metrics here; /flush_cache, /get_server_info on a real engine)."""
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        for name in ("..%2F..%2Fmetrics", "..", "fake-model%3Fx=1", "%2E%2E%2F%2E%2E%2Fmetrics"):
            got = await client.get(router.url + "/v1/models/" + name)
            assert got.status_code == 404, (name, got.text)
            assert "kubesgl_" not in got.text, name
        empty = await client.get(router.url + "/v1/models/")  # answered by the router itself
    # as an engine (and OpenAI) answers a model it does not serve; it said not_found_error
    assert empty.json()["error"] == {
        "message": "the model '' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


async def test_openai_sdk_streams_through_the_router(engines, start_router):
    a = await engines("a", tokens=5)
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        sdk = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused")
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream]
        await sdk.close()
    assert pieces == [f"a-tok{i} " for i in range(5)]


async def test_stream_chunks_reach_the_client_before_the_worker_finishes(
    engines, start_router, client
):
    a = await engines("a", tokens=4)
    a.hold, a.hold_after_chunks = asyncio.Event(), 2
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        body = {"prompt": "x", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            events = (line async for line in response.aiter_lines() if line)
            async with asyncio.timeout(5):  # buffering would hold these until the worker ends
                first, second = await anext(events), await anext(events)
            assert not a.hold.is_set()
            texts = [
                json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in (first, second)
            ]
            assert texts == ["a-tok0 ", "a-tok1 "]
            a.hold.set()
            rest = [line async for line in events]
    assert rest == [rest[0], rest[1], "data: [DONE]"] and "a-tok3" in rest[1]


async def test_client_disconnect_cancels_the_upstream_request(engines, start_router, caplog):
    a = await engines("a", tokens=3)
    a.hold = asyncio.Event()
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        with caplog.at_level("INFO", logger="kubesgl.router.access"):
            async with httpx.AsyncClient() as own_client:
                body = {"prompt": "x", "stream": True}
                async with own_client.stream(
                    "POST", router.url + "/v1/completions", json=body
                ) as response:
                    await anext(response.aiter_lines())
            # The client is gone (its connection closed); the worker must see its request dropped.
            async with asyncio.timeout(5):
                await a.client_gone.wait()
                while not _access_lines(caplog):
                    await asyncio.sleep(0.01)
        assert router.app.workers.all()[0].in_flight == 0
    # its access line tells it from a whole answer
    [line] = _access_lines(caplog)
    assert line.startswith("POST /v1/completions 200 ") and line.endswith(" unfinished"), line


def _access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kubesgl.router.access"]


async def test_a_client_that_leaves_after_done_had_its_whole_answer(
    engines, start_router, client, caplog
):
    """Many SSE clients close the connection at `data: [DONE]`, before the body's end: that
    answer was whole, counted by its status, not as cancelled."""
    a = await engines("a", tokens=3)
    a.eof_after_done_s = 0.5
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        with caplog.at_level("INFO", logger="kubesgl.router.access"):
            async with httpx.AsyncClient() as own_client:
                body = {"prompt": "x", "stream": True}
                async with own_client.stream(
                    "POST", router.url + "/v1/completions", json=body
                ) as response:
                    lines = [line async for line in _until_done(response.aiter_lines())]
            assert lines[-1] == "data: [DONE]"
            async with asyncio.timeout(5):
                while router.app.workers.all()[0].in_flight or not _access_lines(caplog):
                    await asyncio.sleep(0.02)
        text = (await client.get(router.url + "/metrics")).text
    assert f'kubesgl_router_requests_total{{status="200",worker="{a.url}"}} 1.0' in text
    assert f'kubesgl_router_requests_total{{status="cancelled",worker="{a.url}"}} 0.0' in text
    [line] = _access_lines(caplog)
    assert line.startswith("POST /v1/completions 200 ") and line.endswith("s"), line


async def test_a_stream_broken_off_after_its_done_was_whole(engines, start_router, client):
    """The worker's [DONE] came, then its connection broke before the body's end: the client
    has its whole answer, and no error event or second [DONE] follows; counted by its status."""
    a = await engines("a", tokens=3)
    a.eof_after_done_s = 30.0
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        body = {"prompt": "s", "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            lines = (line async for line in response.aiter_lines() if line)
            seen = [line async for line in _until_done(lines)]
            await a.kill()
            async with asyncio.timeout(5):
                rest = [line async for line in lines]
        text = (await client.get(router.url + "/metrics")).text
    assert seen[-1] == "data: [DONE]" and rest == [], rest
    assert f'kubesgl_router_requests_total{{status="200",worker="{a.url}"}} 1.0' in text
    assert f'kubesgl_router_requests_total{{status="error",worker="{a.url}"}} 0.0' in text


async def _until_done(lines):
    async for line in lines:
        yield line
        if line == "data: [DONE]":
            return


async def test_client_disconnect_while_waiting_for_a_non_streaming_answer(engines, start_router):
    a = await engines("a")
    a.hold = asyncio.Event()
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        async with httpx.AsyncClient() as own_client:
            pending = asyncio.ensure_future(
                own_client.post(router.url + "/v1/completions", json={"prompt": "x"})
            )
            await a.wait_for_requests(1)
            pending.cancel()  # closes the client's connection while the worker still works
            with pytest.raises(asyncio.CancelledError):
                await pending
        async with asyncio.timeout(5):
            await a.client_gone.wait()
        assert router.app.workers.all()[0].in_flight == 0


async def test_bad_json_is_a_400_with_an_openai_error_body(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        not_json = await client.post(router.url + "/v1/chat/completions", content=b"{nope")
        no_messages = await client.post(router.url + "/v1/chat/completions", json={"model": "m"})
        bad_stream = await client.post(
            router.url + "/v1/completions", json={"prompt": "x", "stream": "yes"}
        )
    for response in (not_json, no_messages, bad_stream):
        assert response.status_code == 400
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] is None
    assert no_messages.json()["error"]["param"] == "messages"
    assert a.requests == []  # bad input never reaches a worker


async def test_worker_errors_pass_through_unchanged(engines, start_router, client):
    a = await engines("a")
    a.fail_status = 400
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "a fails on purpose"


async def test_no_worker_is_a_503_with_a_clear_message(start_router, client):
    checks = HealthSettings(interval_s=3.2, timeout_s=1.0)
    async with start_router(health=checks, breaker_cooldown_s=10.0) as router:
        health = await client.get(router.url + "/health")
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert health.status_code == 503
    assert response.status_code == 503
    # OpenAI's SDKs wait this long before their retry: until the next health check
    assert response.headers["retry-after"] == health.headers["retry-after"] == "4"
    error = response.json()["error"]
    assert error["code"] is None and "no worker is registered" in error["message"]


async def test_liveness_answers_while_no_worker_can_serve(engines, start_router, client):
    """/liveness is the router pod's liveness probe: a router with no worker, or whose workers
    died, is unready (/health 503) but not broken, and must not be restarted for it."""
    async with start_router() as router:
        alone = [await client.get(router.url + path) for path in ("/liveness", "/health")]
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        await a.kill()
        await router.until(lambda: not router.app.can_serve(), timeout=5)
        dead = [await client.get(router.url + path) for path in ("/liveness", "/health")]
    for liveness, health in (alone, dead):
        assert liveness.status_code == 200 and liveness.json() == {"status": "ok"}
        assert health.status_code == 503


async def test_health_503_is_no_rejection(engines, start_router, client):
    """Rejections are requests sent to no worker; the readiness answer of the router itself is
    none (`kubesgl up` asks it twice a second while the pool is not ready)."""

    def counted(metrics: str) -> dict[str, float]:
        lines = [line.split() for line in metrics.splitlines() if line and line[0] != "#"]
        return {
            name: float(value)
            for name, value in lines
            if name.startswith("kubesgl_router_rejections_total{")
            or name == 'kubesgl_router_requests_total{status="503",worker=""}'
        }

    a = await engines("a")
    a.healthy = False
    async with start_router(workers=[a.url]) as router:
        before = counted((await client.get(router.url + "/metrics")).text)
        healths = [await client.get(router.url + "/health") for _ in range(3)]
        after_health = counted((await client.get(router.url + "/metrics")).text)
        response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        after_request = counted((await client.get(router.url + "/metrics")).text)
    assert [h.status_code for h in healths] == [503] * 3
    error = healths[0].json()["error"]
    assert error["type"] == "service_unavailable" and "1 failing health checks" in error["message"]
    assert response.status_code == 503 and response.json() == healths[0].json()
    assert before and all(v == 0 for v in before.values()) and after_health == before
    assert after_request == {
        **before,
        'kubesgl_router_rejections_total{reason="no_worker",status="503"}': 1.0,
        'kubesgl_router_requests_total{status="503",worker=""}': 1.0,
    }


async def test_unknown_route_and_wrong_method(start_router, client):
    async with start_router() as router:
        missing = await client.get(router.url + "/nope")
        wrong = await client.get(router.url + "/v1/completions", headers={"x-request-id": "t-1"})
        responses = await client.post(router.url + "/v1/responses", json={"input": "x"})
    assert missing.status_code == 404 and wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "/v1/completions accepts POST"
    assert wrong.headers["allow"] == "POST"  # which HTTP requires of a 405 (it had none)
    # an OpenAI route that is not served says so, in the engines' words
    assert "/v1/chat/completions" in responses.json()["error"]["message"]
    assert responses.status_code == 404
    # the id of the access log's line, on the router's own answers too (the SDK's _request_id)
    assert len(missing.headers["x-request-id"]) == 32 and wrong.headers["x-request-id"] == "t-1"


async def test_an_answer_carries_one_request_id(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        answer = await client.post(
            router.url + "/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "t-2"}
        )
    assert answer.headers.get_list("x-request-id") == ["t-2"]


async def test_metrics_expose_the_router_series(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url], policy="cache_aware") as router:
        await router.ready()
        await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        text = (await client.get(router.url + "/metrics")).text
    assert f'kubesgl_router_requests_total{{status="200",worker="{a.url}"}} 1.0' in text
    assert f'kubesgl_router_worker_healthy{{worker="{a.url}"}} 1.0' in text
    assert f'kubesgl_router_worker_load{{worker="{a.url}"}} 0.0' in text
    assert 'kubesgl_router_cache_decisions_total{decision="miss"} 1.0' in text
    assert "kubesgl_router_request_duration_seconds_count 1.0" in text
    assert "kubesgl_router_retries_total 0.0" in text
