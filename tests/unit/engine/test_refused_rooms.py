"""A request the API server refuses before the engine sees it ends its bootstrap rooms in the
engine all the same (RoomRefused): a prefill engine's decode engine hears of the refusal at
once instead of waiting for KV that never comes (docs/disaggregation.md, failures)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import zmq

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.ipc import Endpoints, pull
from kubesgl.engine.messages import BootstrapTarget, EngineInfo, RoomRefused, TokenizeRequest
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerState
from kubesgl.engine.server.engine_client import EngineClient

CONTEXT = 64


class RefusingClient:
    """What the routes use of the EngineClient before a request reaches the engine; the
    rooms it is told of are kept."""

    def __init__(self):
        self.metrics = EngineMetrics("prefill")
        self.ready = asyncio.Event()
        self.failure = None  # the engine runs
        self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=CONTEXT, max_total_tokens=8192)
        self.in_flight = self.user_requests = 0
        self.refused: list[tuple[list[BootstrapTarget], str, int]] = []

    async def refuse_rooms(self, targets: list[BootstrapTarget], message: str, status: int):
        self.refused.append((targets, message, status))


async def _post(
    client: RefusingClient | EngineClient, path: str, body: dict, draining: bool = False
) -> httpx.Response:
    config = EngineConfig(
        model="m", role="prefill", disaggregation_bootstrap_port=8998, max_stop_string_length=8
    )
    app = build_app(client, ServerState(config, "m", draining=draining))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        return await http.post(path, json=body)


ROOM = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}
HELLO = {"role": "user", "content": "hi"}


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
@pytest.mark.parametrize(
    ("path", "body", "draining", "status"),
    [
        ("/v1/completions", {"model": "other", "prompt": "hi", "n": 2}, False, 404),
        ("/v1/chat/completions", {"model": "other", "messages": [HELLO]}, False, 404),
        ("/generate", {"text": "hi"}, True, 503),
    ],
    ids=["completions-model", "chat-model", "generate-draining"],
)
async def test_a_refusal_before_serving_ends_every_room(path, body, draining, status):
    """Another model's name, or an engine draining, where its partner engine serves the
    request (the two disagree during a rolling upgrade; SGLang's router sends it to both
    anyway): the partner learns at once instead of waiting for the KV until its timeout."""
    client = RefusingClient()
    response = await _post(client, path, {**body, **ROOM}, draining)
    assert response.status_code == status
    copies = body.get("n", 1)
    rooms = [BootstrapTarget(7 + i, "10.0.0.1", 8998) for i in range(copies)]
    assert client.refused == [(rooms, response.json()["error"]["message"], status)]


@pytest.mark.asyncio
async def test_a_loading_engine_ends_no_room():
    """Its scheduler reads no message until it is ready."""
    client = RefusingClient()
    client.ready.clear()
    response = await _post(client, "/v1/completions", {"model": "m", "prompt": "hi", **ROOM})
    assert response.status_code == 503 and "loading" in response.text
    assert client.refused == []


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


@pytest.fixture
async def engine_client():
    """A real EngineClient, ready, and the tokenizer's end of its pipe (what it sends, in order)."""
    endpoints = Endpoints.create()
    tokenizer = pull(zmq.Context.instance(), endpoints.tokenizer_in)
    client = EngineClient(endpoints, EngineMetrics("prefill"))
    client.info = EngineInfo("m", CONTEXT, 1000, 8192, 1, "LlamaForCausalLM", [2])
    client.ready.set()
    yield client, tokenizer
    tokenizer.close(linger=0)
    await client.aclose()
    shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


def _received(tokenizer: zmq.Socket) -> list:
    messages = []
    while tokenizer.poll(200):
        messages.append(tokenizer.recv_pyobj())
    return messages


@pytest.mark.asyncio
@pytest.mark.parametrize(("retry_room", "ends_room"), [(7, False), (8, True)])
async def test_a_retry_refused_for_its_rid_ends_no_room_of_the_live_request(
    engine_client, retry_room, ends_room
):
    """/generate retried with the same rid while the first copy is registered but not sent
    yet (its handler has not run on to the send): the retry's 400 must not end the room the
    live request holds, for its RoomRefused would reach the scheduler first and abandon the
    room (the live request then answers 409). A retry with a room of its own ends that one."""
    client, tokenizer = engine_client
    target = BootstrapTarget(7, "10.0.0.1", 8998)
    live = client.generate(TokenizeRequest("r1", SamplingParams(), input_ids=[5], bootstrap=target))
    retry = {"rid": "r1", "input_ids": [5], **ROOM, "bootstrap_room": retry_room}
    response = await _post(client, "/generate", retry)
    assert response.status_code == 400 and "already in use" in response.text
    sending = asyncio.ensure_future(anext(live))  # the live request's handler goes on: sent
    messages = await asyncio.to_thread(_received, tokenizer)
    refused = [m.target.room for m in messages if isinstance(m, RoomRefused)]
    assert refused == ([retry_room] if ends_room else [])
    assert [m.rid for m in messages if isinstance(m, TokenizeRequest)] == ["r1"]
    sending.cancel()
    await asyncio.gather(sending, return_exceptions=True)
