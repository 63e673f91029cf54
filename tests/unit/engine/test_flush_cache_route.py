"""/flush_cache never hangs: 503 while the model loads or the server drains, 503 when the
scheduler does not answer in time, and its answer otherwise."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server import sglang_routes
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerState


class FlushingClient:
    """What the routes use of the EngineClient; the scheduler answers a flush with `answer`,
    or never when it is None."""

    def __init__(self, ready: bool, answer: bool | None):
        self.metrics = EngineMetrics("mixed")
        self.ready = asyncio.Event()
        self.failure = None  # the engine runs
        if ready:
            self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=4096, max_total_tokens=8192)
        self.in_flight = self.user_requests = 0
        self.answer = answer

    async def flush_cache(self) -> bool:
        if self.answer is None:
            await asyncio.Event().wait()
        return bool(self.answer)


async def _flush(client: FlushingClient, draining: bool = False) -> httpx.Response:
    state = ServerState(EngineConfig(model="m"), "m", draining=draining)
    app = build_app(client, state)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        return await http.post("/flush_cache")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("ready", "answer", "status", "text"),
    [
        (False, True, 503, "not flushed: the model is still loading"),
        (True, None, 503, "no answer from the scheduler within 0.2 s"),
        (True, False, 400, "not flushed: the engine is still finishing requests"),
        (True, True, 200, "Cache flushed."),
    ],
)
async def test_flush_cache_answers_in_bounded_time(monkeypatch, ready, answer, status, text):
    monkeypatch.setattr(sglang_routes, "FLUSH_CACHE_TIMEOUT_S", 0.2)
    response = await asyncio.wait_for(_flush(FlushingClient(ready, answer)), 5)
    assert response.status_code == status
    assert response.text.startswith(text)


@pytest.mark.asyncio
async def test_flush_cache_is_refused_while_the_server_drains():
    """As /health: a draining engine takes no more work, and its requests are still ending."""
    response = await asyncio.wait_for(_flush(FlushingClient(True, True), draining=True), 5)
    assert (response.status_code, response.text) == (
        503,
        "not flushed: the server is shutting down",
    )


@pytest.mark.asyncio
async def test_a_health_probe_in_flight_is_no_running_request_to_flush():
    """/health_generate's one-token request is no user's: it was answered "1 requests are
    running"; the scheduler, which flushes only when idle, still has the last word."""
    client = FlushingClient(True, True)
    client.in_flight = 1  # the probe
    response = await asyncio.wait_for(_flush(client), 5)
    assert (response.status_code, response.text) == (200, "Cache flushed.")
    client.user_requests = 2
    response = await asyncio.wait_for(_flush(client), 5)
    assert (response.status_code, response.text) == (400, "not flushed: 2 requests are running")
