"""Talking to one worker: send a request, then buffer or stream its answer back.

A streamed answer is committed to the client only once the worker's first body chunk has
arrived; until then any failure is an `UpstreamError` that the caller may retry elsewhere.
After that, a broken stream ends with an SSE error event and `data: [DONE]`, never silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import aiohttp

from kubesgl.contract import API_KEY_ENV, RETRY_AFTER_S, ROUTER_UPSTREAM_KEEP_ALIVE_S
from kubesgl.router.breaker import Trial
from kubesgl.router.errors import RouterError, error_body, sse_error_event
from kubesgl.router.metrics import CONNECTION_LIMIT, RouterMetrics
from kubesgl.router.security import GuardedResolver
from kubesgl.router.workers import Role, Worker

log = logging.getLogger("kubesgl.router")

# Statuses that say the worker refused the request before working on it (overloaded, still
# loading, draining): another worker may take it. Any other failure of a request that reached
# a worker is the client's answer: a request that crashed one engine must not visit the rest.
RETRYABLE_STATUSES = frozenset({429, 503})
SSE_DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI or SGLang stream


def sse_stream_end(last_chunk: bytes, message: str) -> bytes:
    """The error event and [DONE] that end a stream cut short after `last_chunk`: chunks need
    not end where events do, and an event cut midway is closed first, or the client would read
    the error as the rest of its line."""
    gap = b"" if not last_chunk or last_chunk.endswith(b"\n\n") else b"\n\n"
    return gap + sse_error_event(message) + SSE_DONE


# Headers of one connection, not of the message; `date` is the router's own to send (the
# server adds it), so a worker's would only duplicate it.
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"date",
    }
)  # fmt: skip

# The client's credentials: the router checks them (docs/router.md, Security) and engines never
# see them; they get the router's own key instead.
_CLIENT_CREDENTIALS = frozenset({b"authorization", b"cookie"})

# A prefill engine's answer for a room that was closed before its scheduler took the request: its
# decode engine refused the request first (engine/scheduler/roles.py)
ROOM_CLOSED_STATUS = 409

Headers = list[tuple[bytes, bytes]]
# Failures of a worker connection: refused, reset, cut mid-body, too slow to answer.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Of those, the ones before the request left this process: the worker never saw it.
NOT_SENT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# A pooled keep-alive connection closed or reset before any answer: the worker most likely
# closed it idle (uvicorn's keep-alive, SGLang's server's, is 5 s) as the request went out, and
# never read it; aiohttp itself sends only idempotent methods again then. A fresh connection so
# closed is no such race: it may be the request that killed the worker.
STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# The most times one request goes again on another connection for a stale pooled one: each
# failure drops its connection, so these only bound a pool that others keep refilling.
STALE_CONNECTION_RETRIES = 3
# How soon after its headers went out a pooled connection's failure counts as stale: a worker
# that closed it idle answers the request with a close or reset within a round trip (and the
# router's event loop's lag); later, the worker may have read the request and worked on it.
STALE_CONNECTION_S = 0.25


def end_to_end_headers(headers: Headers) -> Headers:
    """Drops the headers that describe one connection, not the message: the standard ones
    and those a `Connection` header names (RFC 9110, 7.6.1)."""
    named = {
        token.strip().lower()
        for k, v in headers
        if k.lower() == b"connection"
        for token in v.split(b",")
    }
    return [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP and k.lower() not in named]


def forwarded_headers(headers: Headers, credentials: Headers) -> Headers:
    """The client's end-to-end headers for an engine: its credentials replaced by the router's."""
    kept = [(k, v) for k, v in end_to_end_headers(headers) if k.lower() not in _CLIENT_CREDENTIALS]
    return kept + credentials


def _as_text(headers: Headers) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]


@dataclass
class ConnectionUse:
    """What one request's connection was, told by the session's trace (`_reuse_trace`)."""

    reused: bool = False  # taken from the pool, not opened for it
    sent_at: float | None = None  # when its headers were written (time.monotonic)

    def went_stale(self, exc: BaseException) -> bool:
        """Closed under the request by its worker's idle timeout, the request unread: a pooled
        connection that failed as the request went out. One that failed later may have been
        worked on (a non-streamed answer's headers come only with its end): not sent again."""
        return (
            self.reused
            and isinstance(exc, STALE_CONNECTION_ERRORS)
            and (self.sent_at is None or time.monotonic() - self.sent_at <= STALE_CONNECTION_S)
        )


def _reuse_trace() -> aiohttp.TraceConfig:
    def use_of(context: object) -> ConnectionUse | None:
        use = getattr(context, "trace_request_ctx", None)
        return use if isinstance(use, ConnectionUse) else None

    async def reused(session: aiohttp.ClientSession, context: object, params: object) -> None:
        if use := use_of(context):
            use.reused = True

    async def sent(session: aiohttp.ClientSession, context: object, params: object) -> None:
        if use := use_of(context):
            use.sent_at = time.monotonic()

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(reused)
    trace.on_request_headers_sent.append(sent)
    return trace


def make_session(connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """The pooled client for all worker traffic: keep-alive connections, bytes passed as they are,
    never to a link-local or metadata address, whatever a worker's name resolves to. Its
    connector sets no limit: `ConnectionSlots` admits requests, so aiohttp's connect timeout
    measures the connection itself (DNS, TCP, TLS), never a wait for a free slot. It tells each
    request whether its connection came from the pool (`ConnectionUse`)."""
    return aiohttp.ClientSession(
        connector=_unlimited_connector(),
        trace_configs=[_reuse_trace()],
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=connect_timeout_s,
            sock_connect=connect_timeout_s,
            sock_read=read_timeout_s,
        ),
        auto_decompress=False,  # compressed answers go to the client compressed, as sent
        skip_auto_headers=("Accept-Encoding", "User-Agent"),  # only what the client itself sent
    )


def make_control_session() -> aiohttp.ClientSession:
    """The router's own small requests to workers (health checks, model lists, room cancels),
    apart from the traffic it passes on: a pool full of long streams must not fail them (and
    take healthy workers out). No connection limit: each worker has one check in flight at a
    time, and each request bounds its own time (its `total` timeout)."""
    return aiohttp.ClientSession(
        connector=_unlimited_connector(), skip_auto_headers=("User-Agent",)
    )


def _unlimited_connector() -> aiohttp.TCPConnector:
    """Keep-alive connections to workers, never to a link-local or metadata address whatever a
    worker's name resolves to; no limit of aiohttp's (the sessions' callers bound their own)."""
    return aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        resolver=GuardedResolver(),
        keepalive_timeout=ROUTER_UPSTREAM_KEEP_ALIVE_S,
    )


class ConnectionSlots:
    """The router's admission of requests to workers: at most `limit` open at once (the
    --max-connections). A request that finds no free slot within `wait_s` is refused by the
    router (`pool_full`), a 503 with Retry-After: the wait says nothing of any worker, so it
    moves no breaker and fails no health check."""

    def __init__(self, limit: int | None, wait_s: float) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self._free = asyncio.Semaphore(limit) if limit is not None else None
        # One taker at a time: two P/D pairs each holding one of the last two slots would
        # wait on each other's second until both timed out.
        self._taking = asyncio.Lock()

    async def acquire(self) -> Callable[[], None]:
        """Waits for a slot; returns its release (idempotent)."""
        return (await self.acquire_together(1))[0]

    async def acquire_together(self, count: int) -> list[Callable[[], None]]:
        """Waits for `count` slots, taken at once (a P/D pair's two requests); returns their
        releases. A wait that times out or is cancelled keeps none."""
        free = self._free
        if free is None:
            return [lambda: None] * count
        releases: list[Callable[[], None]] = []
        try:
            async with asyncio.timeout(self.wait_s), self._taking:
                for _ in range(count):
                    await free.acquire()
                    releases.append(_release_once(free))
        except BaseException as error:
            for release in releases:
                release()
            if isinstance(error, TimeoutError):
                raise pool_full(self.limit or 0, self.wait_s) from None
            raise
        return releases


def _release_once(free: asyncio.Semaphore) -> Callable[[], None]:
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            free.release()

    return release


# The Retry-After of the router's 503 when no connection is free, or when every worker tried
# was busy (its 503 passed on)
TRY_AGAIN_LATER = (b"retry-after", str(RETRY_AFTER_S).encode())


def retry_after_of(headers: Headers) -> bytes | None:
    """A worker's Retry-After, to pass on as sent, if valid (RFC 9110, 10.2.3): seconds, a
    non-negative integer, or an HTTP date. None for none, or for one that is neither: the
    router's own then goes instead, as a client must not get a value it cannot read."""
    value = next((v.strip() for k, v in headers if k.lower() == b"retry-after"), None)
    if value is None:
        return None
    if value.isdigit():  # bytes: ASCII digits only
        return value
    try:
        parsedate_to_datetime(value.decode("latin-1"))
    except (ValueError, TypeError):
        return None
    return value


def pool_full(limit: int, wait_s: float) -> RouterError:
    return RouterError(
        503,
        f"the router has {limit} requests open to its workers (--max-connections) and no slot "
        f"freed within {wait_s:g} s (--connect-timeout); try again",
        "service_unavailable",
        code=CONNECTION_LIMIT,
        headers=[TRY_AGAIN_LATER],
        reason=CONNECTION_LIMIT,
    )


# What a client reads when a worker's stream breaks off, by the error's type (the first that
# matches). The exception's own text, for the log only, names aiohttp's internals: its
# "TransferEncodingError: 400" is no HTTP status.
_BREAK_OFF_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (asyncio.TimeoutError, "it sent nothing within the router's read timeout"),
    (aiohttp.ClientPayloadError, "the connection ended before the response did"),
    (aiohttp.ClientError, "the connection broke"),
)


def _break_off_reason(exc: BaseException) -> str:
    return next(plain for kind, plain in _BREAK_OFF_REASONS if isinstance(exc, kind))


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class UpstreamError(Exception):
    """A worker failed a request before anything reached the client."""

    def __init__(
        self,
        worker: Worker,
        status: int,
        message: str,
        *,
        retryable: bool,
        body: bytes | None = None,
        answered: bool = False,
        before_work: bool = False,
        retry_after: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.status = status
        self.message = message
        self.retryable = retryable
        self._body = body
        self.retry_after = retry_after  # the worker's valid Retry-After (retry_after_of)
        self.answered = answered  # the worker answered with this error (it was reached)
        # its connection was refused, reset or closed (not merely slow): its process is gone
        self.connection_lost = False
        # a P/D prefill worker's broken connection that its decode worker passed on before it
        # sent the client anything: the request may go once more elsewhere (pd.py); only
        # once, as it may be the request that broke the engine
        self.retry_once = False
        # the worker did nothing for the request (a retryable refusal is one; the router's
        # key refused is another, not retried: every engine would refuse it)
        self.before_work = before_work or retryable
        # A 5xx answer of one side of a P/D pair, whose attempt waits for the pair's verdict
        # (`settle`): it may be the other side's failure (pd.py).
        self._pending: Attempt | None = None

    def settle(self, *, blamed: bool, answers_client: bool = False) -> None:
        """Ends the attempt of a P/D pair's answer with the pair's verdict: `blamed`, its
        answer was its own (a 5xx: its worker failed the request); else it only passed on the
        other side's failure or refusal, and is not told to its breaker: counted as
        `cancelled`, unless `answers_client` (the client gets this very answer and no other
        attempt is blamed for it), then by its status, so that the client's 5xx is in a 5xx
        series. Nothing for an error ended already."""
        attempt, self._pending = self._pending, None
        if attempt is not None:
            if blamed:
                attempt.finish(str(self.status), worker_failed=_failed_by(self.status))
            elif answers_client:
                attempt.finish(str(self.status), worker_failed=None)
            else:
                attempt.finish("cancelled", worker_failed=None)

    def body(self) -> bytes:
        return self._body or error_body(self.message, error_type="upstream_error")

    @classmethod
    def unreachable(cls, worker: Worker, exc: Exception, *, sent: bool = False) -> UpstreamError:
        """The connection failed: retryable only if the request never left, this time or
        before (`sent`: on a pooled connection that closed under it)."""
        message = f"{worker.role.value} worker {worker.url} failed: {_reason(exc)}"
        not_sent = isinstance(exc, NOT_SENT_ERRORS) and not sent
        error = cls(worker, 502, message, retryable=not_sent)
        error.connection_lost = _connection_lost(exc)
        return error

    @classmethod
    def from_answer(
        cls, worker: Worker, status: int, body: bytes, retry_after: bytes | None = None
    ) -> UpstreamError:
        """An error answer. Client errors (4xx) pass through verbatim: they are the caller's."""
        try:
            message = str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError, RecursionError):
            message = body.decode(errors="replace").strip()[:500] or f"HTTP {status}"
        if status == 401:  # clients' credentials never reach engines: the router's own were refused
            message = (
                f"{worker.role.value} worker {worker.url} refused the router's credentials ({message}): "
                f"start the router with {API_KEY_ENV} set to the engines' API key"
            )
            log.error("%s", message)
            return cls(worker, 502, message, retryable=False, before_work=True)
        retryable = status in RETRYABLE_STATUSES
        if status < 500:
            return cls(
                worker,
                status,
                message,
                retryable=retryable,
                body=body,
                answered=True,
                retry_after=retry_after,
            )
        message = f"{worker.role.value} worker {worker.url} answered {status}: {message}"
        return cls(
            worker, status, message, retryable=retryable, answered=True, retry_after=retry_after
        )


@dataclass
class BufferedReply:
    status: int
    headers: Headers
    body: bytes


class Stream:
    """The body of a streamed answer, chunk by chunk; whoever takes it must `aclose()` it.
    Closing releases what the answer holds even if no chunk was read: an async generator
    closed before its first chunk runs none of its body, its `finally` included."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        release: Callable[[], Awaitable[None]],
        attempt: Attempt | None = None,
    ) -> None:
        self._chunks, self._release, self._attempt = chunks, release, attempt
        self._started = self._closed = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        self._started = True  # the generator enters its `try` in the same step
        return await anext(self._chunks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._chunks.aclose()  # a started generator releases in its `finally`
        if not self._started:  # a finished one must not: its prefill may still be answering
            await self._release()

    @property
    def broke_off(self) -> bool:
        """The worker failed mid-answer (the stream ended with an SSE error event)."""
        return self._attempt is not None and self._attempt.worker_failed is True


@dataclass
class StreamingReply:
    status: int
    headers: Headers
    chunks: Stream


Reply = BufferedReply | StreamingReply


class Attempt:
    """One request on one worker: counts it in flight and records its outcome exactly once."""

    __slots__ = ("worker", "_breaker", "_metrics", "_finished", "_trial", "worker_failed")

    def __init__(self, worker: Worker, metrics: RouterMetrics, trial: Trial | None = None) -> None:
        """`trial`: the half-open trial claimed when the worker was chosen, this request's now."""
        self.worker = worker
        # The breaker it was sent under: a worker that re-entered the pool since (a restart,
        # as far as the router can tell) has a new one, which this request's end must not move.
        self._breaker = worker.breaker
        self._metrics = metrics
        self._finished = False
        self.worker_failed: bool | None = None  # set at the end; None: no verdict (finish)
        worker.in_flight += 1
        if trial is not None and trial.breaker is not self._breaker:
            trial.end()  # claimed of the breaker the worker had before it re-entered the pool
            trial = None
        self._trial = trial or self._breaker.claim_trial()

    def finish(
        self, status: str, *, worker_failed: bool | None, open_now: str | None = None
    ) -> None:
        """`worker_failed` None: no verdict on the worker, whose breaker is not told (neither a
        failure nor a success; a half-open trial lets the next request through): the request
        was cancelled (the client left, or the other side of a P/D pair failed), or answered
        with a client's error (4xx). `open_now`: why its failure opens the worker's circuit at
        once, whatever the threshold (`CircuitBreaker.record_failure`)."""
        if self._finished:
            return
        self._finished = True
        self.worker_failed = worker_failed
        self.worker.in_flight -= 1
        breaker = self._breaker
        if self._trial is not None:
            self._trial.end()
        if worker_failed:
            was_open = not breaker.allows_requests()
            breaker.record_failure(open_now=open_now is not None)
            if not was_open and not breaker.allows_requests() and breaker is self.worker.breaker:
                if open_now is not None:
                    log.warning(
                        "worker %s: circuit breaker open at once: %s", self.worker.url, open_now
                    )
                else:
                    log.warning(
                        "worker %s: circuit breaker open after %d failed requests (%s)",
                        self.worker.url,
                        breaker.consecutive_failures,
                        status,
                    )
        elif worker_failed is False:
            breaker.record_success()
        self._metrics.attempt_finished(self.worker, status)


def _failed_by(status: int) -> bool | None:
    """The verdict on a worker that answered an error: a 5xx is its failure, but a 503, "not
    now" (its queue full, or it loads or drains: the health checks see those), which like a
    client's error (4xx) says nothing of it, neither way."""
    return True if status >= 500 and status != 503 else None


def _may_pass_on(worker: Worker, status: int) -> bool:
    """An error answer of one side of a P/D pair that may be the other side's outcome passed on:
    a 5xx (its partner failed the room), or a prefill engine's 409 (its decode engine refused
    the request and closed the room first)."""
    return status >= 500 or (status == ROOM_CLOSED_STATUS and worker.role is Role.PREFILL)


def _connection_lost(exc: BaseException) -> bool:
    """Refused, reset or closed (not merely slow): the worker's process is gone or going."""
    connection_error = isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError)
    return connection_error and not isinstance(exc, asyncio.TimeoutError)


class UpstreamClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        on_worker_lost: Callable[[Worker], None] = lambda worker: None,
        slots: ConnectionSlots | None = None,
        control_session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.session = session
        # the router's own requests (room cancels); None: `session` (tests)
        self.control_session = control_session or session
        self.slots = slots or ConnectionSlots(None, 0)
        self.metrics = metrics
        # Takes a worker whose connection broke out of the pool at once, not at the next
        # health check, so the requests that follow go elsewhere.
        self.on_worker_lost = on_worker_lost

    def _failed(self, worker: Worker, exc: Exception, *, sent: bool = False) -> UpstreamError:
        if _connection_lost(exc):
            self.on_worker_lost(worker)
        return UpstreamError.unreachable(worker, exc, sent=sent)

    async def _open(
        self, worker: Worker, method: str, path: str, payload: bytes | None, headers: Headers
    ) -> aiohttp.ClientResponse:
        """The answer's start. A stale pooled connection (`STALE_CONNECTION_ERRORS`) is no
        failure of the worker's: the request goes again, on another connection. A failure after
        one is the request's answer, not retried elsewhere (`UpstreamError.retryable`) even if
        the connection was refused: the closed one may have been the worker dying of it."""
        stale = 0
        while True:
            use = ConnectionUse()
            try:
                return await self.session.request(
                    method,
                    worker.url + path,
                    data=payload,
                    headers=_as_text(headers),
                    trace_request_ctx=use,
                )
            except TRANSPORT_ERRORS as exc:
                if use.went_stale(exc) and stale < STALE_CONNECTION_RETRIES:
                    stale += 1
                    log.debug("worker %s closed a pooled connection: %s", worker.url, _reason(exc))
                    continue
                raise self._failed(worker, exc, sent=stale > 0) from exc

    async def exchange(
        self,
        worker: Worker,
        method: str,
        path: str,
        payload: bytes | None,
        headers: Headers,
        *,
        stream: bool,
        paired: bool = False,
        on_attempt: Callable[[Attempt], None] | None = None,
        slot: Callable[[], None] | None = None,
        trial: Trial | None = None,
    ) -> Reply:
        """Sends one request; returns a complete answer, or a stream once its first chunk is in.

        `paired`: one side of a P/D pair, which answers 5xx also when the other side failed
        (an engine whose partner failed a room answers 502), and a prefill engine 409 when its
        decode engine refused the request: such an answer's attempt is left for the pair to
        end (`UpstreamError.settle`), which decides whose answer it was (_may_pass_on).
        `on_attempt` gets the request's attempt once it is counted in flight: a pair that
        finds the worker failed it while it has not answered ends it so before closing it.
        `slot`: the release of a slot taken for it (a P/D pair takes its two at once).
        `trial`: the worker's half-open trial, claimed for it by a caller that chose the worker
        before this ran (a P/D pair); else claimed here, as the worker was chosen just now."""
        # before any wait: another request choosing the worker meanwhile must not be a trial too
        trial = trial or worker.breaker.claim_trial()
        try:
            # before the attempt: a request the router refuses for want of a slot never reached it
            release_slot = slot or await self.slots.acquire()
        except BaseException:
            if trial is not None:
                trial.end()  # never sent: the next request may be the trial
            raise
        try:
            attempt = Attempt(worker, self.metrics, trial)
        except BaseException:
            if trial is not None:
                trial.end()
            release_slot()
            raise
        if on_attempt is not None:
            on_attempt(attempt)
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._open(worker, method, path, payload, headers)
            status = response.status
            reply_headers = end_to_end_headers(list(response.raw_headers))
            if status >= 400 or not stream:
                body = await self._read_all(worker, response)
                if status >= 400:
                    error = UpstreamError.from_answer(
                        worker, status, body, retry_after_of(reply_headers)
                    )
                    if paired and _may_pass_on(worker, status):  # the pair decides whose it was
                        error._pending = attempt
                    else:
                        attempt.finish(str(status), worker_failed=_failed_by(status))
                    raise error
                attempt.finish(str(status), worker_failed=False)
                release_slot()  # its connection is back in the pool (_read_all)
                return BufferedReply(status, reply_headers, body)
            chunks = response.content.iter_any()
            try:
                first = await anext(chunks, b"")
            except TRANSPORT_ERRORS as exc:
                raise self._failed(worker, exc) from exc
        except UpstreamError as error:
            if error._pending is None:
                attempt.finish("error", worker_failed=True)
            if response is not None:
                response.close()
            release_slot()
            raise
        except BaseException:  # cancelled: the client left, or the other side of a P/D pair failed
            attempt.finish("cancelled", worker_failed=None)
            if response is not None:
                response.close()
            release_slot()
            raise

        async def release() -> None:
            attempt.finish("cancelled", worker_failed=None)
            response.close()
            release_slot()

        relay = self._relay(first, chunks, response, attempt, release_slot)
        return StreamingReply(status, reply_headers, Stream(relay, release, attempt))

    async def _read_all(self, worker: Worker, response: aiohttp.ClientResponse) -> bytes:
        try:
            body = await response.read()
        except TRANSPORT_ERRORS as exc:
            response.close()
            raise self._failed(worker, exc) from exc
        response.release()  # read to the end: the connection goes back to the pool
        return body

    async def _relay(
        self,
        first: bytes,
        chunks: AsyncIterator[bytes],
        response: aiohttp.ClientResponse,
        attempt: Attempt,
        release_slot: Callable[[], None] = lambda: None,
    ) -> AsyncGenerator[bytes, None]:
        complete = False
        # The worker's last event is being sent or was sent: a client may leave then, its
        # answer whole (set before the yield, which a client leaving mid-send interrupts)
        done_sent = False
        last = first
        try:
            if first:
                done_sent = first.endswith(SSE_DONE)
                yield first
            async for chunk in chunks:
                done_sent, last = chunk.endswith(SSE_DONE), chunk
                yield chunk
            complete = True
            attempt.finish(str(response.status), worker_failed=False)
        except TRANSPORT_ERRORS as exc:
            worker = attempt.worker
            if _connection_lost(exc):
                self.on_worker_lost(worker)
            if done_sent:  # the client has its whole answer: nothing may follow, nothing failed
                attempt.finish(str(response.status), worker_failed=False)
                return
            attempt.finish("error", worker_failed=True)
            broke_off = f"{worker.role.value} worker {worker.url} broke off the stream"
            log.warning("%s: %s", broke_off, _reason(exc))
            message = f"{broke_off}: {_break_off_reason(exc)}"
            # [DONE] still follows, as it follows an engine's own error event (SGLang's and
            # vLLM's, on /generate too): clients that read up to [DONE] see the stream end
            self.metrics.broken_streams.labels("worker").inc()
            yield sse_stream_end(last, message)
        except (asyncio.CancelledError, GeneratorExit):
            if done_sent:  # a client that stops reading at [DONE] had its whole answer
                attempt.finish(str(response.status), worker_failed=False)
            attempt.finish("cancelled", worker_failed=None)
            raise
        finally:
            attempt.finish("cancelled", worker_failed=None)  # whatever else ended it; once only
            if complete:
                response.release()
            else:
                response.close()  # an unfinished answer: closing the connection aborts it upstream
            release_slot()

    async def drain(
        self,
        worker: Worker,
        path: str,
        payload: bytes,
        headers: Headers,
        *,
        paired: bool = False,
        on_attempt: Callable[[Attempt], None] | None = None,
        slot: Callable[[], None] | None = None,
        trial: Trial | None = None,
    ) -> None:
        """Sends a request and reads its answer to the end, raising if it failed."""
        await self.exchange(
            worker,
            "POST",
            path,
            payload,
            headers,
            stream=False,
            paired=paired,
            on_attempt=on_attempt,
            slot=slot,
            trial=trial,
        )
