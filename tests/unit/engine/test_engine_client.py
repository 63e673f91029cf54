"""The API server's end of the engine: every output of a request reaches its reader, also
when several arrive before the reader runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import zmq

from kubesgl.engine.ipc import Endpoints, push
from kubesgl.engine.messages import FinishReason, TextBatch, TextOutput, TokenizeRequest
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.server.engine_client import EngineClient


@pytest.fixture
async def client():
    endpoints = Endpoints.create()
    engine_client = EngineClient(endpoints, EngineMetrics("mixed"))
    engine_client.start()
    detokenizer = push(zmq.Context.instance(), endpoints.api_in)
    yield engine_client, detokenizer
    await engine_client.shutdown()
    # Close the sockets now: a context collected later with sockets open waits for them forever.
    detokenizer.close(linger=0)
    engine_client._context.destroy(linger=0)
    shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.mark.asyncio
async def test_outputs_that_arrive_together_all_reach_the_reader(client):
    engine_client, detokenizer = client
    stream = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    # The first token and the last arrive in one batch, before the reader has run once.
    detokenizer.send_pyobj(
        TextBatch(
            [
                TextOutput("r1", "a", [5], None, 3, 0, 1),
                TextOutput("r1", "b", [6], FinishReason("length"), 3, 0, 2),
            ]
        )
    )
    outputs = [out async for out in stream]
    assert [out.token_ids for out in outputs] == [[5], [6]]
    assert outputs[-1].finish_reason.kind == "length"
