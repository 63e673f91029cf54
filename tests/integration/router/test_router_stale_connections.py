"""A pooled keep-alive connection that the worker closes as a request goes out on it (its idle
timeout, 5 s in uvicorn, SGLang's server, fired just then): the worker never worked on the
request, which goes once more on a fresh connection, the worker staying in the pool. A worker
that closes a fresh connection under a request, or whose fresh connection is refused after its
pooled one closed, may have died of it: it leaves the pool, and the request goes nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct
from collections.abc import AsyncIterator, Callable

import pytest

from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.policies import RoundRobinPolicy
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.routing import DisaggregationSettings, Forwarder, Policies, RetrySettings
from kubesgl.router.upstream import BufferedReply, UpstreamClient, UpstreamError, make_session
from kubesgl.router.workers import Role, Worker, WorkerRegistry

pytestmark = pytest.mark.asyncio

PORTS = range(27000, 28000)  # the ports these tests' servers may take
ANSWER = b'{"choices": [{"text": "ok"}]}'


class RawEngine:
    """An HTTP/1.1 server that answers each request 200 on a keep-alive connection, unless
    `closes(n)` says the n-th request on its connection gets the connection closed instead,
    without a byte of answer (`reset`: reset); `crash` then also stops it listening (its
    process died)."""

    def __init__(
        self,
        closes: Callable[[int], bool],
        crash: bool = False,
        reset: bool = False,
        works_s: float = 0.0,
    ) -> None:
        """`works_s`: how long it works on a request before closing its connection."""
        self.closes, self.crash, self.reset, self.works_s = closes, crash, reset, works_s
        self.received = 0  # requests read, answered or not
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_connection = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                self.received += 1
                on_connection += 1
                if self.closes(on_connection):
                    await asyncio.sleep(self.works_s)
                    if self.crash and self.server is not None:
                        self.server.close()
                    if self.reset:  # no linger: the close sends RST
                        linger = struct.pack("ii", 1, 0)
                        writer.get_extra_info("socket").setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, linger
                        )
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> None:
        for port in PORTS:
            with contextlib.suppress(OSError):
                self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
                self.url = f"http://127.0.0.1:{port}"
                return
        raise RuntimeError(f"no free port in {PORTS}")


@contextlib.asynccontextmanager
async def pool(*engines: RawEngine) -> AsyncIterator[tuple[Forwarder, list[Worker]]]:
    """A router's forwarder over `engines` (healthy), with its real connection pool."""
    for engine in engines:
        await engine.start()
    registry = WorkerRegistry()
    workers = [registry.add(engine.url, Role.MIXED) for engine in engines]
    for worker in workers:
        registry.set_healthy(worker, True)
    metrics = RouterMetrics(registry)
    session = make_session(connect_timeout_s=2.0, read_timeout_s=5.0)
    client = UpstreamClient(session, metrics, on_worker_lost=registry.mark_lost)
    policy = RoundRobinPolicy()
    forwarder = Forwarder(
        registry,
        Policies(policy, policy, policy),
        client,
        metrics,
        RetrySettings(initial_backoff_s=0, max_backoff_s=0),
        DisaggregationSettings(),
    )
    try:
        yield forwarder, workers
    finally:
        await session.close()
        for engine in engines:
            if engine.server is not None:
                engine.server.close()


async def generate(forwarder: Forwarder) -> BufferedReply | UpstreamError:
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    try:
        reply = await forwarder.generate(parse_generation_request("/v1/completions", body), [])
    except UpstreamError as error:
        return error
    assert isinstance(reply, BufferedReply)
    return reply


async def warm(forwarder: Forwarder, worker: Worker) -> None:
    """One request answered on a connection that then waits in the pool."""
    reply = await forwarder.upstream.exchange(
        worker, "POST", "/v1/completions", b"{}", [], stream=False
    )
    assert isinstance(reply, BufferedReply) and reply.status == 200


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_pooled_connection_closed_under_a_request_is_retried_on_a_fresh_one(reset):
    engine = RawEngine(closes=lambda n: n == 2, reset=reset)  # idle timeout as the 2nd comes
    async with pool(engine) as (forwarder, [worker]):
        await warm(forwarder, worker)
        reply = await generate(forwarder)
        assert isinstance(reply, BufferedReply) and reply.status == 200
        assert engine.received == 3  # the closed one, then the same on a fresh connection
        assert worker.healthy and not worker.lost and worker.breaker.consecutive_failures == 0
        retries = forwarder.metrics.registry.get_sample_value("kubesgl_router_retries_total")
        assert retries == 0  # not sent to another worker


async def test_a_pooled_connection_closed_after_the_worker_worked_on_the_request_is_no_race():
    """Reset a second into the request (a non-streamed answer's headers come at its end): the
    worker read the request and may have generated; it was sent to it again."""
    engine = RawEngine(closes=lambda n: n == 2, reset=True, works_s=1.0)
    async with pool(engine) as (forwarder, [worker]):
        await warm(forwarder, worker)
        error = await generate(forwarder)
        assert isinstance(error, UpstreamError) and error.status == 502
        assert engine.received == 2  # once, not again


async def test_a_fresh_connection_closed_under_a_request_is_a_lost_worker_and_the_answer():
    engines = RawEngine(closes=lambda n: True), RawEngine(closes=lambda n: False)
    async with pool(*engines) as (forwarder, [dead, other]):
        error = await generate(forwarder)
        assert isinstance(error, UpstreamError) and error.status == 502
        assert engines[0].received == 1 and engines[1].received == 0  # sent once, nowhere else
        assert dead.lost and not dead.healthy


async def test_a_worker_that_died_under_a_request_on_a_pooled_connection_gets_it_once():
    """Its pooled connection closed under the request, then a fresh one is refused: it may have
    died of that request, which must not go to the other workers."""
    engines = RawEngine(closes=lambda n: n == 2, crash=True), RawEngine(closes=lambda n: False)
    async with pool(*engines) as (forwarder, [dead, other]):
        await warm(forwarder, dead)
        error = await generate(forwarder)  # round robin: the dead one first
        assert isinstance(error, UpstreamError) and error.status == 502
        assert engines[0].received == 2 and engines[1].received == 0
        assert dead.lost and not dead.healthy
