"""vLLM's /version, /tokenize and /detokenize, served by the engine in vLLM's shapes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from kubesgl import __version__
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server.api import ServerState, build_app

pytestmark = pytest.mark.asyncio


class ReadyClient:
    """What the routes use of an EngineClient whose engine is ready."""

    def __init__(self):
        self.metrics = EngineMetrics("mixed")
        self.ready = asyncio.Event()
        self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=4096, max_total_tokens=8192)


def http(client, api_key: str | None = None) -> httpx.AsyncClient:
    state = ServerState(EngineConfig(model="m"), "m", api_key=api_key)
    transport = httpx.ASGITransport(app=build_app(client, state))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://engine")


async def test_version_is_kubesgls_as_vllm_shapes_it_and_needs_no_key():
    async with http(ReadyClient(), api_key="secret") as engine:
        response = await engine.get("/version")
    assert response.status_code == 200 and response.json() == {"version": __version__}
