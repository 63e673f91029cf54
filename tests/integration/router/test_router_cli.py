"""`kubesgl router` as a real process, driven with the openai SDK."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from kubesgl.contract import ADMIN_KEY_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until_ready(
    url: str, process: subprocess.Popen[bytes], timeout: float = 20.0
) -> None:
    """Polls /health: the only readiness signal another process offers."""
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
        while True:
            assert process.poll() is None, "the router exited"
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_router_process_serves_openai_clients(engines):
    a, b = await engines("a", tokens=3), await engines("b", tokens=3)
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "router",
            "--worker",
            a.url,
            b.url,
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--health-check-interval",
            "0.2",
            "--log-level",
            "warning",
        ],  # fmt: skip
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_ready(url, process)
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        completion = await sdk.completions.create(model="fake-model", prompt="hi", max_tokens=3)
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        streamed = "".join([chunk.choices[0].delta.content async for chunk in stream])
        models = await sdk.models.list()
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.chat.completions.create(model="fake-model", messages=[])
        await sdk.close()
    finally:
        process.terminate()
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    assert completion.choices[0].text.startswith(("a-tok0", "b-tok0"))
    assert streamed.count("-tok") == 3
    assert [m.id for m in models.data] == ["fake-model"]
    assert "messages" in str(bad.value)
    assert len(a.requests) + len(b.requests) == 2 and a.requests and b.requests


def test_bad_command_lines_exit_with_a_usage_error():
    run = subprocess.run(
        [sys.executable, "-m", "kubesgl", "router", "--worker", "http://a:1", "--decode", "http://d:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "not both" in run.stderr


def test_a_router_that_could_never_get_a_worker_is_a_usage_error():
    """No worker, no discovery and no admin key (so no POST /workers): it used to warn, then
    run, answering every request 503 until stopped."""
    environ = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}
    run = subprocess.run(
        [sys.executable, "-m", "kubesgl", "router", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=environ,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "no workers, and no way to add one" in run.stderr and ADMIN_KEY_ENV in run.stderr


@pytest.mark.asyncio
async def test_sigusr1_checks_the_workers_out_of_the_pool_at_once(engines):
    """SIGUSR1, from whoever restarted an engine and saw it ready: the router checks the workers
    out of its pool then, not at its next health check (60 s here), and leaves those in the pool
    alone."""
    in_pool, out = await engines("in"), await engines("out")
    out.healthy = False
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kubesgl", "router", "--worker", in_pool.url, out.url,
            "--port", str(port), "--health-check-interval", "60", "--log-level", "warning",
        ],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_ready(url, process)  # `in` serves
        await asyncio.sleep(0.5)  # the checks of the start are over
        checked = len(in_pool.probe_headers), len(out.probe_headers)
        assert checked[1] >= 1
        out.healthy = True
        process.send_signal(signal.SIGUSR1)
        async with httpx.AsyncClient() as client, asyncio.timeout(5):
            while True:
                assert process.poll() is None, "the router exited"
                listing = (await client.get(url + "/workers")).json()["workers"]
                if {w["url"]: w["healthy"] for w in listing}[out.url]:
                    break
                await asyncio.sleep(0.05)
        assert len(in_pool.probe_headers) == checked[0]
    finally:
        process.terminate()
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)


@pytest.mark.asyncio
async def test_a_stream_the_shutdown_cuts_ends_with_an_error_event_and_done(engines):
    """SIGTERM gives streams --shutdown-timeout to finish; one still running then is cut, and
    ends as a stream a worker broke off does (an SSE error event, then [DONE]), not silently."""
    engine = await engines("e", tokens=3)
    engine.hold = asyncio.Event()  # the stream pauses after its first chunk
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "kubesgl", "router", "--worker", engine.url,
            "--port", str(port), "--shutdown-timeout", "1", "--log-level", "warning",
        ],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_ready(url, process)
        async with httpx.AsyncClient(timeout=20) as client:
            body = {"prompt": "hi", "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as answer:
                lines = (line async for line in answer.aiter_lines() if line)
                assert "e-tok0" in await anext(lines)
                process.terminate()
                rest = [line async for line in lines]
        # the router exits once the stream is ended
        assert process.wait(timeout=10) in (0, -signal.SIGTERM)
    finally:
        engine.hold.set()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert rest[-1] == "data: [DONE]", rest
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"] and "--shutdown-timeout (1 s)" in error["message"]
