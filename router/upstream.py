"""Talking to one worker: send a request, then buffer or stream its answer back.

A streamed answer is committed to the client only once the worker's first body chunk has
arrived; until then any failure is an `UpstreamError` that the caller may retry elsewhere.
After that, a broken stream ends with an SSE error event, never silently.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from kubesgl.router.errors import error_body, sse_error_event
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.workers import Worker

# Statuses worth another worker: overload, draining, gateway trouble, server faults.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

# Headers of one connection, not of the message; `date` is the router's own to send (the
# server adds it), so a worker's would only duplicate it.
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"date",
    }
)  # fmt: skip

Headers = list[tuple[bytes, bytes]]
# Failures of a worker connection: refused, reset, cut mid-body, too slow to answer.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def end_to_end_headers(headers: Headers) -> Headers:
    """Drops the headers that describe one connection, not the message."""
    return [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]


def _as_text(headers: Headers) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]


def make_session(max_connections: int, connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """The pooled client for all worker traffic: keep-alive connections, bytes passed as they are."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s),
        auto_decompress=False,  # compressed answers go to the client compressed, as sent
        skip_auto_headers=("Accept-Encoding", "User-Agent"),  # only what the client itself sent
    )


class UpstreamError(Exception):
    """A worker failed a request before anything reached the client."""

    def __init__(
        self, worker: Worker, status: int, message: str, *, retryable: bool, body: bytes | None = None
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.status = status
        self.message = message
        self.retryable = retryable
        self._body = body

    def body(self) -> bytes:
        return self._body or error_body(self.message, self.status, error_type="upstream_error")

    @classmethod
    def unreachable(cls, worker: Worker, exc: Exception) -> UpstreamError:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        message = f"{worker.role.value} worker {worker.url} failed: {reason}"
        return cls(worker, 502, message, retryable=True)

    @classmethod
    def from_answer(cls, worker: Worker, status: int, body: bytes) -> UpstreamError:
        """An error answer. Client errors (4xx) pass through verbatim: they are the caller's."""
        try:
            message = str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = body.decode(errors="replace").strip()[:500] or f"HTTP {status}"
        if status < 500:
            return cls(worker, status, message, retryable=status in RETRYABLE_STATUSES, body=body)
        message = f"{worker.role.value} worker {worker.url} answered {status}: {message}"
        return cls(worker, status, message, retryable=status in RETRYABLE_STATUSES)


@dataclass
class BufferedReply:
    status: int
    headers: Headers
    body: bytes


@dataclass
class StreamingReply:
    status: int
    headers: Headers
    chunks: AsyncIterator[bytes]  # an async generator: the consumer must aclose() it


Reply = BufferedReply | StreamingReply


class Attempt:
    """One request on one worker: counts it in flight and records its outcome exactly once."""

    __slots__ = ("worker", "_metrics", "_finished")

    def __init__(self, worker: Worker, metrics: RouterMetrics) -> None:
        self.worker = worker
        self._metrics = metrics
        self._finished = False
        worker.in_flight += 1

    def finish(self, status: str, *, worker_failed: bool) -> None:
        if self._finished:
            return
        self._finished = True
        self.worker.in_flight -= 1
        if worker_failed:
            self.worker.breaker.record_failure()
        else:
            self.worker.breaker.record_success()
        self._metrics.requests.labels(self.worker.url, status).inc()


class UpstreamClient:
    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.session = session
        self.metrics = metrics

    async def _open(
        self, worker: Worker, method: str, path: str, payload: bytes | None, headers: Headers
    ) -> aiohttp.ClientResponse:
        try:
            return await self.session.request(
                method, worker.url + path, data=payload, headers=_as_text(headers)
            )
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError.unreachable(worker, exc) from exc

    async def exchange(
        self,
        worker: Worker,
        method: str,
        path: str,
        payload: bytes | None,
        headers: Headers,
        *,
        stream: bool,
    ) -> Reply:
        """Sends one request; returns a complete answer, or a stream once its first chunk is in."""
        attempt = Attempt(worker, self.metrics)
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._open(worker, method, path, payload, headers)
            status = response.status
            reply_headers = end_to_end_headers(list(response.raw_headers))
            if status >= 400 or not stream:
                body = await self._read_all(worker, response)
                if status >= 400:
                    attempt.finish(str(status), worker_failed=status >= 500)
                    raise UpstreamError.from_answer(worker, status, body)
                attempt.finish(str(status), worker_failed=False)
                return BufferedReply(status, reply_headers, body)
            chunks = response.content.iter_any()
            try:
                first = await anext(chunks, b"")
            except TRANSPORT_ERRORS as exc:
                raise UpstreamError.unreachable(worker, exc) from exc
        except UpstreamError:
            attempt.finish("error", worker_failed=True)
            if response is not None:
                response.close()
            raise
        except BaseException:  # cancelled: the client left, or the other side of a P/D pair failed
            attempt.finish("cancelled", worker_failed=False)
            if response is not None:
                response.close()
            raise
        return StreamingReply(status, reply_headers, self._relay(first, chunks, response, attempt))

    @staticmethod
    async def _read_all(worker: Worker, response: aiohttp.ClientResponse) -> bytes:
        try:
            body = await response.read()
        except TRANSPORT_ERRORS as exc:
            response.close()
            raise UpstreamError.unreachable(worker, exc) from exc
        response.release()  # read to the end: the connection goes back to the pool
        return body

    @staticmethod
    async def _relay(
        first: bytes, chunks: AsyncIterator[bytes], response: aiohttp.ClientResponse, attempt: Attempt
    ) -> AsyncIterator[bytes]:
        complete = False
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
            complete = True
            attempt.finish(str(response.status), worker_failed=False)
        except TRANSPORT_ERRORS as exc:
            attempt.finish("error", worker_failed=True)
            worker = attempt.worker
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            yield sse_error_event(
                f"{worker.role.value} worker {worker.url} broke off the stream: {reason}", 502
            )
        except (asyncio.CancelledError, GeneratorExit):
            attempt.finish("cancelled", worker_failed=False)
            raise
        finally:
            if complete:
                response.release()
            else:
                response.close()  # an unfinished answer: closing the connection aborts it upstream

    async def drain(self, worker: Worker, path: str, payload: bytes, headers: Headers) -> None:
        """Sends a request and reads its answer to the end, raising if it failed."""
        await self.exchange(worker, "POST", path, payload, headers, stream=False)
