"""A streamed answer's relay ends its attempt however the stream ends."""

from __future__ import annotations

import asyncio

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
