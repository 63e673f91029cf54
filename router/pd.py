"""Prefill/decode disaggregation (docs/disaggregation.md): one request, sent to a prefill and a decode
worker at once, tied together by `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.

The decode worker's answer goes to the client; the prefill worker's is drained. A prefill
failure while the decode answer is still incomplete ends that answer with a clear error
(the decode worker cannot finish without the prefill's KV cache).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from kubesgl.router.errors import sse_error_event
from kubesgl.router.request_parsing import ParsedRequest
from kubesgl.router.upstream import (
    Headers,
    Reply,
    Stream,
    StreamingReply,
    UpstreamClient,
    UpstreamError,
)
from kubesgl.router.workers import Worker

log = logging.getLogger("kubesgl.router")

_END: Any = object()  # what anext() returns once a stream is exhausted


def bootstrap_payload(request: ParsedRequest, prefill: Worker) -> bytes:
    """The request both workers get: the client's JSON plus the three bootstrap fields, with
    a new room for every attempt and one per choice (a list when there are several)."""
    rooms = [draw_bootstrap_room() for _ in range(request.choices)]
    return json.dumps(
        {
            **request.body,
            "bootstrap_host": prefill.host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": rooms[0] if request.choices == 1 else rooms,
        }
    ).encode()


def draw_bootstrap_room() -> int:
    return random.getrandbits(63)


# How long one engine's error waits for the other engine's answer before the router cancels
# that request (see `_unless_prefill_fails`, `exchange`): engines tell each other at once, and
# a request one refuses the other refuses too (the same rules), so this only bounds an engine
# that heard nothing (its partner died without a word). An engine whose request is cancelled
# counts it as aborted by its client, which a refused request was not.
DECODE_VERDICT_WAIT_S = 1.0


class PrefillDecodePair:
    def __init__(self, upstream: UpstreamClient) -> None:
        self.upstream = upstream
        # Prefill drains that outlive the client's answer; kept so they are not garbage collected.
        self._background: set[asyncio.Task[None]] = set()

    async def exchange(
        self, request: ParsedRequest, prefill: Worker, decode: Worker, headers: Headers
    ) -> Reply:
        payload = bootstrap_payload(request, prefill)
        prefill_task = asyncio.create_task(
            self.upstream.drain(prefill, request.path, payload, headers)
        )
        try:
            reply = await self._unless_prefill_fails(
                self.upstream.exchange(
                    decode, "POST", request.path, payload, headers, stream=request.stream
                ),
                prefill_task,
            )
        except BaseException as error:
            if _refused(error):  # the decode engine's 4xx: the prefill engine's follows
                await asyncio.wait({prefill_task}, timeout=DECODE_VERDICT_WAIT_S)
            await _cancel(prefill_task)
            raise
        if isinstance(reply, StreamingReply):
            decode_stream = reply.chunks

            async def release() -> None:  # if no chunk was ever read
                await _cancel(prefill_task)
                await decode_stream.aclose()

            watching = self._stream_watching_prefill(decode_stream, prefill_task)
            reply.chunks = Stream(watching, release)
        else:
            self._let_finish(prefill_task)
        return reply

    @staticmethod
    async def _unless_prefill_fails(
        decode_call: Coroutine[Any, Any, Reply], prefill_task: asyncio.Task[None]
    ) -> Reply:
        decode_task = asyncio.create_task(decode_call)
        try:
            await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            error = None if decode_task.done() else prefill_task.exception()
            if error is not None:
                if (
                    isinstance(error, UpstreamError)
                    and error.answered
                    and error.status >= 500
                    and not error.retryable  # refused before any work: nobody was told
                ):
                    # A prefill engine that failed a room has told its decode engine, whose
                    # answer follows in milliseconds; a 4xx from it is the real answer (it
                    # refused the request and cancelled the room, which failed the prefill).
                    await asyncio.wait({decode_task}, timeout=DECODE_VERDICT_WAIT_S)
                    if _client_error(decode_task):
                        return await decode_task  # raises the decode engine's 4xx
                elif _refused(error):  # the decode engine refuses it too, or fails when told
                    await asyncio.wait({decode_task}, timeout=DECODE_VERDICT_WAIT_S)
                raise error
            return await decode_task
        except BaseException:
            await _cancel(decode_task)
            if (
                decode_task.done()
                and not decode_task.cancelled()
                and decode_task.exception() is None
            ):
                reply = decode_task.result()
                if isinstance(reply, StreamingReply):
                    await reply.chunks.aclose()
            raise

    async def _stream_watching_prefill(
        self, chunks: Stream, prefill_task: asyncio.Task[None]
    ) -> AsyncGenerator[bytes, None]:
        # The decode engine answered (a chunk, or its end): it had the KV, so the prefill's
        # work is done, and its request may end on its own even if the client leaves now.
        answered = False
        try:
            # Race each chunk against the prefill only while the prefill is still running.
            while not prefill_task.done():
                next_chunk = asyncio.ensure_future(anext(chunks, _END))
                try:
                    await asyncio.wait(
                        {next_chunk, prefill_task}, return_when=asyncio.FIRST_COMPLETED
                    )
                except BaseException:
                    await _cancel(next_chunk)
                    raise
                if not next_chunk.done() and prefill_task.exception() is not None:
                    await _cancel(next_chunk)
                    break
                chunk = await next_chunk
                answered = True
                if chunk is _END:
                    return
                yield chunk
            error = prefill_task.exception()
            if error is not None:
                message = error.message if isinstance(error, UpstreamError) else repr(error)
                yield sse_error_event(message)
                return
            answered = True  # the prefill has ended, and well
            async for chunk in chunks:
                yield chunk
        finally:
            if answered and not chunks.broke_off:  # a decode that broke off needs no prefill
                self._let_finish(prefill_task)
            else:
                await _cancel(prefill_task)
            await chunks.aclose()

    def _let_finish(self, prefill_task: asyncio.Task[None]) -> None:
        """The client has its answer: the prefill drain may end on its own, errors only logged."""
        if prefill_task.done():
            _log_outcome(prefill_task)
            return
        self._background.add(prefill_task)
        prefill_task.add_done_callback(self._background.discard)
        prefill_task.add_done_callback(_log_outcome)


def _log_outcome(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("prefill failed after the decode answer was complete: %s", task.exception())


def _client_error(task: asyncio.Task[Reply]) -> bool:
    if not task.done() or task.cancelled():
        return False
    error = task.exception()
    return isinstance(error, UpstreamError) and error.status < 500


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
