"""A served engine with --max-queued-requests: a burst beyond its queue gets 503s with
Retry-After at once (streams too, as a status, not an error event), the requests it took all
finish, a request of more sequences than the queue holds is served whole, and a health probe
is taken whatever the queue."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from serve_harness import start_server

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(
        tiny_model("llama"),
        "--served-model-name",
        "tiny",
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "2",
        tmp_path=tmp_path_factory.mktemp("queue"),
    )
    yield server
    assert server.stop() == 0


def _body(i: int, stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": f"request {i}",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


async def _burst(base_url: str, count: int) -> list[tuple[int, dict, str, str | None]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(i: int):
            stream = i % 2 == 1
            response = await client.post("/v1/completions", json=_body(i, stream))
            text = response.text
            body = response.json() if not stream or response.status_code != 200 else {}
            return response.status_code, body, text, response.headers.get("retry-after")

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_burst_beyond_the_queue_is_refused_at_once_and_the_rest_is_served(server):
    answers = asyncio.run(_burst(server.base_url, 12))
    refused = [a for a in answers if a[0] == 503]
    served = [a for a in answers if a[0] == 200]
    assert len(refused) + len(served) == 12, [a[0] for a in answers]
    assert refused and len(served) >= 2  # the two the queue holds, at the least (all may come
    # before the scheduler admits the first)
    for _, body, _, retry_after in refused:
        assert retry_after == "1"
        assert "queue is full" in body["error"]["message"]
        assert "--max-queued-requests 2" in body["error"]["message"]
    for _, body, text, _ in served:
        if body:
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
        else:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    metrics = httpx.get(f"{server.base_url}/metrics").text
    counted = re.search(r'kubesgl_request_errors_total\{[^}]*status="503"[^}]*\} (\S+)', metrics)
    assert counted is not None and float(counted.group(1)) == len(refused)


def test_a_request_of_more_sequences_than_the_queue_holds_is_served_whole(server):
    body = {**_body(0, False), "n": 3, "prompt": ["one", "two"], "max_tokens": 4}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 6


def test_health_generate_answers_ok_while_the_queue_is_full(server):
    """/health_generate on an engine merely busy is healthy: its 503 "queue is full" took
    the engine out of SGLang's router, and of any probe's rotation."""

    async def run() -> tuple[int, str, int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

            async def load() -> tuple[int, int]:
                (answer,) = (await client.get("/get_load")).json()
                return answer["num_reqs"] - answer["num_waiting_reqs"], answer["num_waiting_reqs"]

            async def until(wanted: tuple[int, int]) -> None:
                while await load() != wanted:
                    assert time.monotonic() < deadline, f"the engine never held {wanted}"
                    await asyncio.sleep(0.02)

            long = {**_body(0, False), "max_tokens": 1500}
            deadline = time.monotonic() + 30

            def start() -> asyncio.Task[httpx.Response]:
                return asyncio.create_task(client.post("/v1/completions", json=long))

            # one running first: three sent at once may all find it not yet admitted, and the
            # third is refused (two wait)
            busy = [start()]
            await until((1, 0))
            busy += [start(), start()]
            await until((1, 2))  # one running, two waiting: the queue is full
            refused = await client.post("/v1/completions", json=_body(1, False))
            probe = asyncio.create_task(client.get("/health_generate"))
            while not probe.done() and (await load())[1] < 3:  # the probe waits its turn
                assert time.monotonic() < deadline, "the probe neither waited nor answered"
                await asyncio.sleep(0.02)
            for task in busy:  # their clients leave: the probe runs
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            answer = await probe
            return answer.status_code, answer.text, refused.status_code

    status, text, refused = asyncio.run(run())
    assert refused == 503  # the queue was full
    assert (status, text) == (200, "ok")
