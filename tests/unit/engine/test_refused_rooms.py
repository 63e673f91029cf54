"""A request the API server refuses before the engine sees it ends its bootstrap rooms in the
engine all the same (RoomRefused): a prefill engine's decode engine hears of the refusal at
once instead of waiting for KV that never comes (docs/disaggregation.md, failures)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.messages import BootstrapTarget
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server.api import ServerState, build_app

CONTEXT = 64


class RefusingClient:
    """What the routes use of the EngineClient before a request reaches the engine; the
    rooms it is told of are kept."""

    def __init__(self):
        self.metrics = EngineMetrics("prefill")
        self.ready = asyncio.Event()
        self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=CONTEXT, max_total_tokens=8192)
        self.in_flight = self.user_requests = 0
        self.refused: list[tuple[list[BootstrapTarget], str, int]] = []

    async def refuse_rooms(self, targets: list[BootstrapTarget], message: str, status: int):
        self.refused.append((targets, message, status))


async def _post(client: RefusingClient, path: str, body: dict) -> httpx.Response:
    config = EngineConfig(
        model="m", role="prefill", disaggregation_bootstrap_port=8998, max_stop_string_length=8
    )
    app = build_app(client, ServerState(config, "m"))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        return await http.post(path, json=body)


ROOM = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5] * CONTEXT, "n": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["a stop string"]},
            "stop",
        ),
        ("/generate", {"input_ids": [5] * CONTEXT}, "input_ids"),
    ],
    ids=["completions", "chat", "generate"],
)
async def test_a_refusal_ends_every_room_of_the_request_with_its_answer(path, body, param):
    client = RefusingClient()
    response = await _post(client, path, {"model": "m", **body, **ROOM})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param
    copies = body.get("n", 1)
    rooms = [BootstrapTarget(7 + i, "10.0.0.1", 8998) for i in range(copies)]
    assert client.refused == [(rooms, error["message"], 400)]


@pytest.mark.asyncio
async def test_a_request_for_too_many_sequences_ends_no_room():
    """Their number would be the client's to choose, not the server's limit."""
    client = RefusingClient()
    body = {"model": "m", "prompt": ["a"] * 300, **ROOM}
    response = await _post(client, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert client.refused == []


@pytest.mark.asyncio
async def test_a_refused_request_without_a_room_ends_none():
    client = RefusingClient()
    response = await _post(client, "/v1/completions", {"model": "m", "prompt": [5] * CONTEXT})
    assert response.status_code == 400
    assert client.refused == []  # the engine is not even told
