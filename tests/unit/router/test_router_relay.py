"""A streamed answer's relay ends its attempt however the stream ends."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.upstream import Attempt, UpstreamClient
from kubesgl.router.workers import Role, WorkerRegistry


class _Response:
    status = 200
    closed = False

    def release(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


async def _chunks_then(error: Exception):
    yield b"data: 1\n\n"
    raise error


def test_a_relay_that_fails_unexpectedly_ends_its_attempt():
    """An error that is no transport error (a bug, say) left the worker counted in flight
    for good, and a half-open breaker's trial never ended."""
    workers = WorkerRegistry()
    worker = workers.add("http://w:1", Role.MIXED)
    metrics = RouterMetrics(workers)
    client = UpstreamClient(None, metrics)  # type: ignore[arg-type]  # no request is sent
    response = _Response()

    async def relay_all() -> None:
        relay = client._relay(
            b"", _chunks_then(ValueError("a bug")), response, Attempt(worker, metrics)
        )  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            async for _ in relay:
                pass

    asyncio.run(relay_all())
    assert worker.in_flight == 0 and response.closed


def _relayed_after(error: Exception, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    """The error event a stream that broke with `error` ends with, and what the router logged."""
    workers = WorkerRegistry()
    worker = workers.add("http://w:1", Role.DECODE)
    metrics = RouterMetrics(workers)
    client = UpstreamClient(None, metrics)  # type: ignore[arg-type]  # no request is sent

    async def relay_all() -> list[bytes]:
        response, attempt = _Response(), Attempt(worker, metrics)
        relay = client._relay(b"", _chunks_then(error), response, attempt)  # type: ignore[arg-type]
        return [chunk async for chunk in relay]

    caplog.set_level(logging.WARNING, logger="kubesgl.router")
    *_, last = asyncio.run(relay_all())
    event = json.loads(last.split(b"\n\n")[0].removeprefix(b"data: "))
    return event["error"]["message"], caplog.text


@pytest.mark.parametrize(
    ("error", "plain"),
    [
        (
            aiohttp.ClientPayloadError(
                "Response payload is not completed: <TransferEncodingError: 400, message='Not "
                "enough data to satisfy transfer length header.'>"
            ),
            "the connection ended before the response did",
        ),
        (aiohttp.ServerDisconnectedError(), "the connection broke"),
        (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), "it sent nothing "),
    ],
    ids=["cut", "disconnected", "silent"],
)
def test_a_broken_stream_ends_with_a_plain_message_and_logs_the_exception(error, plain, caplog):
    """A trial's decode engine died mid-stream: the client read aiohttp's internals, whose
    "400" is no HTTP status. The exception goes to the router's log instead."""
    message, logged = _relayed_after(error, caplog)
    assert message.startswith(f"decode worker http://w:1 broke off the stream: {plain}")
    assert "aiohttp" not in message and type(error).__name__ not in message
    assert type(error).__name__ in logged and "http://w:1" in logged


async def _half_an_event_then(error: Exception):
    yield b'data: {"choices": [{"text": "hel'  # a chunk need not end where its event does
    raise error


def test_a_stream_that_breaks_mid_event_ends_with_an_event_of_its_own():
    workers = WorkerRegistry()
    worker = workers.add("http://w:1", Role.MIXED)
    metrics = RouterMetrics(workers)
    client = UpstreamClient(None, metrics)  # type: ignore[arg-type]  # no request is sent

    async def relay_all() -> bytes:
        chunks = _half_an_event_then(aiohttp.ClientPayloadError("cut"))
        relay = client._relay(b"", chunks, _Response(), Attempt(worker, metrics))  # type: ignore[arg-type]
        return b"".join([chunk async for chunk in relay])

    events = asyncio.run(relay_all()).split(b"\n\n")
    assert events[0] == b'data: {"choices": [{"text": "hel'  # as sent, closed
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["type"] == "upstream_error"
    assert events[2:] == [b"data: [DONE]", b""]
