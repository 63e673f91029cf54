"""Prefill/decode disaggregation (docs/disaggregation.md): one request, sent to a prefill and a decode
worker at once, tied together by `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.

The decode worker's answer goes to the client; the prefill worker's is drained. The decode
engine fails a request by itself when the prefill's KV cache never comes (its prefill engine
refused it, died or went silent), so a prefill failure after the prefill engine may have sent
the KV decides nothing: the decode answer does. The router then cancels the rooms at the
prefill engine's bootstrap server (room_cancel.py): a prefill engine that failed before it
took them told no decode engine. Once the decode engine answers (a streamed answer's first
chunk holds tokens, which need the KV), the prefill's part is done.

An engine whose partner failed a room answers 5xx too (502, or 504 when the partner let it
time out: engine/scheduler/roles.py), so a side's 5xx answer waits for the pair's verdict
before its worker is blamed (`UpstreamError.settle`): the failure the client gets is its
worker's; the other side's answer only passed it on, and counts against no breaker. So does a
prefill engine's 409 for the room its decode engine closed as it refused the request: the
client gets the decode's refusal, and the 409 is no answer of the prefill worker's own.

A decode engine that passes on a prefill failure (502 or 504) while the prefill request has
not answered within DECODE_VERDICT_WAIT_S names a prefill engine that is hung or cannot be
reached (its bootstrap server timed out the decode engine's post, or let the room time out):
the failure is the prefill worker's, whose attempt ends as `error` (its breaker told, as for
a request the router itself timed out), and since the decode engine answered an error before
any output, the request goes to another pair (`UpstreamError.retryable`, without that
prefill worker), as a refusal before any work does.

A prefill request whose connection broke (its engine died mid-prefill) while the decode engine
then passes that failure on (502 or 504, before any output) leaves the client nothing sent and
a decode engine that did nothing wrong: the request goes once more, without that prefill worker
(`UpstreamError.retry_once`), to another pair or a decode worker alone. Only once: it may be
the request that killed the engine, and must not visit every prefill engine in turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeGuard

from kubesgl.contract import BOOTSTRAP_ROOM_BITS, PARTNER_FAILURE_STATUSES, PARTNER_TIMEOUT_STATUS
from kubesgl.router.errors import RouterError
from kubesgl.router.request_parsing import ParsedRequest
from kubesgl.router.room_cancel import cancel_rooms
from kubesgl.router.upstream import (
    Attempt,
    Headers,
    Reply,
    Stream,
    StreamingReply,
    UpstreamClient,
    UpstreamError,
)
from kubesgl.router.workers import Worker

log = logging.getLogger("kubesgl.router")


def bootstrap_payload(request: ParsedRequest, prefill: Worker, rooms: list[int]) -> bytes:
    """The request both workers get: the client's JSON plus the three bootstrap fields, with
    one room per choice (a list when there are several)."""
    return json.dumps(
        {
            **request.body,
            "bootstrap_host": prefill.host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": rooms[0] if request.choices == 1 else rooms,
        }
    ).encode()


def draw_bootstrap_room() -> int:
    return random.getrandbits(BOOTSTRAP_ROOM_BITS)


# How long one engine's failure waits for the other engine's answer before the router decides
# (see `exchange`, `_settle_prefill_failure`, `_decode_verdict`): engines tell each other at
# once, a request one refuses the other refuses too (the same rules), and a room the prefill
# failed fails the decode request, whose error may reach the router before the prefill's
# (the cause). So this only bounds an engine that heard nothing (its partner died without a
# word). An engine whose request is cancelled counts it as aborted by its client, which a
# refused request was not.
DECODE_VERDICT_WAIT_S = 1.0

# How long a router shutting down waits for its prefill drains and room cancels before it
# cancels them (before its HTTP session closes under them). Small: it comes out of the 5 s
# its pod's grace period leaves after its own graceful shutdown (docs/operator.md).
DRAIN_GRACE_AT_SHUTDOWN_S = 3.0


class PrefillDecodePair:
    def __init__(self, upstream: UpstreamClient) -> None:
        self.upstream = upstream
        # Prefill drains that outlive the client's answer, and room cancels; kept so they are
        # not garbage collected.
        self._background: set[asyncio.Task[None]] = set()

    async def exchange(
        self, request: ParsedRequest, prefill: Worker, decode: Worker, headers: Headers
    ) -> Reply:
        rooms = [draw_bootstrap_room() for _ in range(request.choices)]  # new for every attempt
        payload = bootstrap_payload(request, prefill, rooms)
        prefill_attempts: list[Attempt] = []
        # Claimed as the workers are chosen: the requests begin later, in tasks, after the wait
        # for slots, while other requests may choose a half-open worker too.
        trials = [prefill.breaker.claim_trial(), decode.breaker.claim_trial()]
        # Both slots at once: pairs each holding a prefill slot would wait on decode slots.
        # Each task releases its own (and hands its trial to its attempt): both run their
        # first step before this coroutine can be cancelled, as they were scheduled first.
        try:
            prefill_slot, decode_slot = await self.upstream.slots.acquire_together(2)
        except BaseException:
            for trial in trials:
                if trial is not None:
                    trial.end()  # never sent
            raise
        prefill_trial, decode_trial = trials
        prefill_task = asyncio.create_task(
            self.upstream.drain(
                prefill,
                request.path,
                payload,
                headers,
                paired=True,
                on_attempt=prefill_attempts.append,
                slot=prefill_slot,
                trial=prefill_trial,
            )
        )
        try:
            reply = await self._unless_prefill_fails(
                self.upstream.exchange(
                    decode,
                    "POST",
                    request.path,
                    payload,
                    headers,
                    stream=request.stream,
                    paired=True,
                    slot=decode_slot,
                    trial=decode_trial,
                ),
                prefill_task,
                lambda error: self._cancel_rooms(prefill, rooms, error),
            )
        except BaseException as error:
            try:
                if _refused(error):  # the decode engine's 4xx: the prefill engine's follows
                    await asyncio.wait({prefill_task}, timeout=DECODE_VERDICT_WAIT_S)
                elif isinstance(error, _SilentPrefill):
                    # its failure, before its cancel ends it; unreachable, its circuit opens at
                    # once: each request sent to a hung prefill engine waits out the decode
                    # engine's post timeout (10 s) before its retry, until health checks take it
                    # out
                    at_once = error.unreachable_reason()
                    for attempt in prefill_attempts:
                        attempt.finish("error", worker_failed=True, open_now=at_once)
            finally:
                await _cancel(prefill_task)
                _settle(prefill_task, cause=error)
            if isinstance(error, _SilentPrefill):
                raise error.retry_without(prefill) from error.decode_error
            raise
        if isinstance(reply, StreamingReply):
            decode_stream = reply.chunks

            async def release() -> None:  # no chunk was read, but the first had come: so had the KV
                self._let_finish(prefill_task)
                await decode_stream.aclose()

            watching = self._stream_then_settle_prefill(decode_stream, prefill_task)
            reply.chunks = Stream(watching, release)
        else:
            self._let_finish(prefill_task)
        return reply

    @staticmethod
    async def _unless_prefill_fails(
        decode_call: Coroutine[Any, Any, Reply],
        prefill_task: asyncio.Task[None],
        cancel_prefill_rooms: Callable[[BaseException], None],
    ) -> Reply:
        decode_task = asyncio.create_task(decode_call)
        try:
            await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if not decode_task.done() and (error := prefill_task.exception()) is not None:
                await _settle_prefill_failure(decode_task, error)
                cancel_prefill_rooms(error)  # the decode answer decides: it must not wait long
            return await _decode_verdict(decode_task, prefill_task)
        except BaseException as error:
            await _cancel(decode_task)
            _settle(decode_task, cause=error)
            if (
                decode_task.done()
                and not decode_task.cancelled()
                and decode_task.exception() is None
            ):
                reply = decode_task.result()
                if isinstance(reply, StreamingReply):
                    await reply.chunks.aclose()
            raise

    async def _stream_then_settle_prefill(
        self, chunks: Stream, prefill_task: asyncio.Task[None]
    ) -> AsyncGenerator[bytes, None]:
        # The decode engine has streamed (it had the KV): the prefill's part is done, and a
        # failure of its request may no longer touch this answer.
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            if chunks.broke_off:  # a decode that broke off needs no prefill
                await _cancel(prefill_task)
                _settle(prefill_task, cause=_own_failure(prefill_task))
            else:
                self._let_finish(prefill_task)
            await chunks.aclose()

    def _let_finish(self, prefill_task: asyncio.Task[None]) -> None:
        """The client has its answer: the prefill drain may end on its own, errors only logged."""
        if prefill_task.done():
            _log_outcome(prefill_task)
            return
        self._keep(prefill_task)
        prefill_task.add_done_callback(_log_outcome)

    def _cancel_rooms(self, prefill: Worker, rooms: list[int], error: BaseException) -> None:
        """The prefill failed, maybe before it took the rooms (then it told nobody): cancelled
        at its bootstrap server, they fail at the decode engine at once instead of at its
        timeout. Sent in the background: the decode engine's answer does not wait for it."""
        reason = f"the router cancelled it, its prefill request failed: {error}"
        self._keep(
            asyncio.create_task(cancel_rooms(self.upstream.control_session, prefill, rooms, reason))
        )

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        """Ends the background tasks before the router's session closes: they get
        DRAIN_GRACE_AT_SHUTDOWN_S to finish, then are cancelled (a cancelled drain is no
        failure of its worker: the router left, not the engine)."""
        pending = set(self._background)
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_GRACE_AT_SHUTDOWN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _log_outcome(task: asyncio.Task[None]) -> None:
    error = _error_of(task)
    _settle(task, cause=error)  # its own failure
    if error is not None:
        log.warning(
            "prefill failed after its decode engine had the KV cache (the answer went on): %s",
            error,
        )


async def _settle_prefill_failure(decode_task: asyncio.Task[Reply], error: BaseException) -> None:
    """Raises the prefill's error unless the decode engine may still answer well."""
    if isinstance(error, RouterError) or (isinstance(error, UpstreamError) and error.before_work):
        # no KV comes (a retryable refusal goes to another pair; the router's own refusal, no
        # connection slot for the prefill request, is the client's answer)
        raise error
    if _refused(error):  # the decode engine refuses it too, or fails when told
        await asyncio.wait({decode_task}, timeout=DECODE_VERDICT_WAIT_S)
        # The decode engine's refusal is the answer: it may be the cause of the prefill's (a
        # decode engine that refuses a request cancels its room, which the prefill may answer
        # with a 409 before its own check refuses it).
        raise _refusal_of(decode_task) or error
    # The prefill engine failed after it may have sent the KV (it crashed, or failed as it
    # answered): the decode engine has it and answers, or fails the request itself (at once
    # when told of a failed room, within a heartbeat of a dead prefill engine).


async def _decode_verdict(
    decode_task: asyncio.Task[Reply], prefill_task: asyncio.Task[None]
) -> Reply:
    """The decode engine's answer; if it failed for want of the KV, the prefill's error (the
    cause), which may reach the router after the decode engine heard of the failed room. A
    decode engine's refusal (4xx, or before any work) is its true answer, kept, and so is its
    own failure: a broken connection (the prefill's error that follows passes that on), or a
    500 while the prefill engine answered that its partner failed (PARTNER_FAILURE_STATUSES).
    A decode engine that passes on a prefill failure while the prefill request has not
    answered raises _SilentPrefill: the prefill worker failed (hung, or unreachable from its
    decode engine). One that passes on a failure while the prefill request answered well is
    the client's answer, no worker blamed (which side failed, the router cannot tell). A
    prefill's broken connection that the decode engine passes on is retried once
    (`UpstreamError.retry_once`)."""
    try:
        return await decode_task
    except UpstreamError as decode_error:
        if _refused(decode_error) or decode_error.retryable or not decode_error.answered:
            raise  # a decode engine whose connection broke failed by itself
        await asyncio.wait({prefill_task}, timeout=DECODE_VERDICT_WAIT_S)
        if not prefill_task.done() and _passed_on(decode_error):
            decode_error.settle(blamed=False)  # it only passed on the prefill's failure
            raise _SilentPrefill(decode_error) from decode_error
        if not prefill_task.done() or (prefill_error := prefill_task.exception()) is None:
            if _passed_on(decode_error):  # it names a prefill failure the router did not see
                # the client's answer, blamed on neither worker: counted by its status
                decode_error.settle(blamed=False, answers_client=True)
            raise
        if _passed_on(prefill_error) and not _passed_on(decode_error):
            raise  # the decode engine failed by itself (a 500) and told the prefill engine
        if _timed_out_waiting_for_decode(prefill_error) and _passed_on(decode_error):
            # No decode engine asked for the room in time (it stalled) and the decode engine
            # passes that on: the prefill's error says what happened, the failure is the decode's
            # (settled here: the callers' _settle of either error is then a no-op)
            decode_error.settle(blamed=True)
            prefill_error.settle(blamed=False)
        if _lost_connection(prefill_error) and _passed_on(decode_error):
            # The prefill engine died (or its connection broke) and the decode engine failed
            # the request for want of its KV, before any output: another pair, or a decode
            # engine alone, may serve it; once, as it may be the request that killed it
            prefill_error.retry_once = True
        raise prefill_error from decode_error


class _SilentPrefill(Exception):
    """The decode engine passed on a prefill failure (`decode_error`, settled: not its own)
    while the prefill request had not answered within DECODE_VERDICT_WAIT_S."""

    def __init__(self, decode_error: UpstreamError) -> None:
        super().__init__(decode_error.message)
        self.decode_error = decode_error

    def unreachable_reason(self) -> str | None:
        """Why the prefill worker's circuit opens at once: its decode engine could not reach
        it (a 502). None for a room that timed out (a 504), which a prefill engine merely busy
        with a deep queue also causes: one failure towards the threshold."""
        if self.decode_error.status == PARTNER_TIMEOUT_STATUS:
            return None
        return "its decode engine could not reach it"

    def retry_without(self, prefill: Worker) -> UpstreamError:
        """The prefill worker's failure, retryable: the decode engine answered an error before
        any output (a stream's error comes before its first chunk), so another pair may serve
        the request; the client gets the decode engine's answer if none does."""
        decode_error = self.decode_error
        return UpstreamError(
            prefill,
            decode_error.status,
            f"{decode_error.message} (prefill worker {prefill.url} had not answered)",
            retryable=True,
            answered=True,
        )


def _passed_on(error: BaseException) -> bool:
    """An engine's answer for a room its partner failed (PARTNER_FAILURE_STATUSES)."""
    return (
        isinstance(error, UpstreamError)
        and error.answered
        and error.status in PARTNER_FAILURE_STATUSES
    )


def _lost_connection(error: BaseException) -> TypeGuard[UpstreamError]:
    """A side's connection refused, reset or closed before it answered: its engine is gone."""
    return isinstance(error, UpstreamError) and error.connection_lost and not error.answered


def _timed_out_waiting_for_decode(error: BaseException) -> TypeGuard[UpstreamError]:
    """A prefill engine's 504: it gave up on a room no decode engine asked for in time."""
    return (
        isinstance(error, UpstreamError)
        and error.answered
        and error.status == PARTNER_TIMEOUT_STATUS
    )


def _error_of(task: asyncio.Task[Any]) -> BaseException | None:
    """The error a task ended with; None while it runs, or if it was cancelled or succeeded."""
    return None if not task.done() or task.cancelled() else task.exception()


def _own_failure(task: asyncio.Task[Any]) -> BaseException | None:
    """A side's error, unless it passed on its partner's failure (the partner failed too)."""
    error = _error_of(task)
    return None if error is None or _passed_on(error) else error


def _settle(task: asyncio.Task[Any], cause: BaseException | None) -> None:
    """Tells an ended side's 5xx answer the pair's verdict: its worker failed the request if
    its error is `cause` (the one the client gets, or the prefill's own after the decode
    engine answered); otherwise it only passed on the other side's failure, or the client
    left before a verdict: no failure of its own."""
    error = _error_of(task)
    if isinstance(error, UpstreamError):
        error.settle(blamed=error is cause)


def _refusal_of(task: asyncio.Task[Reply]) -> BaseException | None:
    """The engine's 4xx answer, if the task has ended with one."""
    error = _error_of(task)
    return error if error is not None and _refused(error) else None


def _refused(error: BaseException) -> bool:
    """An engine's 4xx answer to the request itself (not a refusal before any work, such as
    a 429, which is retried on another pair)."""
    return (
        isinstance(error, UpstreamError)
        and error.answered
        and error.status < 500
        and not error.retryable
    )


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # marks a stored exception as retrieved
