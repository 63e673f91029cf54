"""An engine request ends when its route is done with it, not when the garbage collector
finds its output stream: until then its request id stays taken (a retry with it is refused
as a duplicate) and, for a client that left, the engine goes on generating for nobody."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.messages import FinishReason, TextOutput
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server import sglang_routes
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerContext, ServerState

_FAILED = FinishReason("error", status=500, message="the step failed")


class HoldingClient:
    """What the routes use of the EngineClient; a request is held from `generate` until its
    output stream is closed (or runs out), as the EngineClient holds its id."""

    def __init__(self, first_finish: FinishReason | None) -> None:
        self.metrics = EngineMetrics("mixed")
        self.ready = asyncio.Event()
        self.failure = None  # the engine runs
        self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=4096, max_total_tokens=8192)
        self.first_finish = first_finish
        self.held: set[str] = set()

    def generate(self, request):
        self.held.add(request.rid)
        return self._outputs(request.rid)

    async def _outputs(self, rid: str):
        try:
            yield TextOutput(rid, "a", [5], self.first_finish, 3, 0, 1)
            yield TextOutput(rid, "b", [6], FinishReason("length"), 3, 0, 2)
        finally:
            self.held.discard(rid)

    async def close(self, rid: str, error: str | None = None) -> None:
        self.held.discard(rid)


@pytest.mark.asyncio
async def test_a_failed_health_probe_ends_its_request_as_it_answers():
    client = HoldingClient(first_finish=_FAILED)
    ctx = ServerContext(client, ServerState(EngineConfig(model="m"), "m"))  # type: ignore[arg-type]
    response = await sglang_routes.health_generate(ctx)
    assert response.status_code == 503
    assert client.held == set()  # checked before the event loop runs anything else


@pytest.mark.asyncio
async def test_a_stream_whose_client_left_before_its_body_started_ends_its_request():
    """Starlette never iterates a streaming body whose client leaves while its headers are
    being sent: it cancels the send when the disconnect comes (ASGI spec 2.3, uvicorn's)."""
    client = HoldingClient(first_finish=None)
    app = build_app(client, ServerState(EngineConfig(model="m"), "m"))  # type: ignore[arg-type]
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"engine")],
        "client": ("127.0.0.1", 24001),
        "server": ("127.0.0.1", 24000),
    }
    request = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if request:
            return request.pop()
        await asyncio.sleep(0.05)  # the client leaves as its answer starts
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(1)  # a slow network: the headers are still going when it leaves

    await asyncio.wait_for(app(scope, receive, send), 5)
    assert client.held == set()  # checked before the event loop runs anything else
