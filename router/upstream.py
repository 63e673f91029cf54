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

import httpx

from kubesgl.router.errors import error_body, sse_error_event
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.workers import Worker

# Statuses worth another worker: overload, draining, gateway trouble, server faults.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)  # fmt: skip

Headers = list[tuple[bytes, bytes]]


def end_to_end_headers(headers: Headers) -> Headers:
    """Drops the headers that describe one connection, not the message."""
    return [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]


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
    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def _open(
        self, worker: Worker, method: str, path: str, payload: bytes | None, headers: Headers
    ) -> httpx.Response:
        request = self.client.build_request(method, worker.url + path, content=payload, headers=headers)
        try:
            return await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
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
        response: httpx.Response | None = None
        try:
            response = await self._open(worker, method, path, payload, headers)
            status = response.status_code
            reply_headers = end_to_end_headers(response.headers.raw)
            if status >= 400 or not stream:
                body = await self._read_all(worker, response)
                if status >= 400:
                    attempt.finish(str(status), worker_failed=status >= 500)
                    raise UpstreamError.from_answer(worker, status, body)
                attempt.finish(str(status), worker_failed=False)
                return BufferedReply(status, reply_headers, body)
            chunks = response.aiter_raw()
            try:
                first = await anext(chunks, b"")
            except httpx.TransportError as exc:
                raise UpstreamError.unreachable(worker, exc) from exc
        except UpstreamError:
            attempt.finish("error", worker_failed=True)
            if response is not None:
                await response.aclose()
            raise
        except BaseException:  # cancelled: the client left, or the other side of a P/D pair failed
            attempt.finish("cancelled", worker_failed=False)
            if response is not None:
                await response.aclose()
            raise
        return StreamingReply(status, reply_headers, self._relay(first, chunks, response, attempt))

    @staticmethod
    async def _read_all(worker: Worker, response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.TransportError as exc:
            raise UpstreamError.unreachable(worker, exc) from exc
        finally:
            await response.aclose()

    @staticmethod
    async def _relay(
        first: bytes, chunks: AsyncIterator[bytes], response: httpx.Response, attempt: Attempt
    ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
            attempt.finish(str(response.status_code), worker_failed=False)
        except httpx.TransportError as exc:
            attempt.finish("error", worker_failed=True)
            worker = attempt.worker
            yield sse_error_event(
                f"{worker.role.value} worker {worker.url} broke off the stream: "
                f"{type(exc).__name__}: {exc}",
                502,
            )
        except (asyncio.CancelledError, GeneratorExit):
            attempt.finish("cancelled", worker_failed=False)
            raise
        finally:
            await response.aclose()

    async def drain(self, worker: Worker, path: str, payload: bytes, headers: Headers) -> None:
        """Sends a request and reads its answer to the end, raising if it failed."""
        await self.exchange(worker, "POST", path, payload, headers, stream=False)
