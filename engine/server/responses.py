"""A generation request's answer (docs/server.md): its engine outputs gathered into one JSON
response, or sent on as server-sent events; a client that leaves aborts its requests."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kubesgl.engine.messages import TextOutput, TokenizeRequest
from kubesgl.engine.server.access import AccessRecord
from kubesgl.engine.server.context import ServerContext
from kubesgl.engine.server.engine_client import EngineClient
from kubesgl.engine.server.errors import APIError, internal_error
from kubesgl.engine.server.openai_format import Choice, Formatter, usage
from kubesgl.engine.server.stream_response import EngineStreamResponse

logger = logging.getLogger(__name__)

Stream = AsyncGenerator[TextOutput, None]  # one request's engine outputs (EngineClient.generate)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# A stream that sends nothing while its text is held back (a named tool call's arguments, a
# long run of a possible stop string) sends an SSE comment this often instead, which clients
# skip: proxies between it and the client close connections idle for a minute or so.
HELD_STREAM_KEEPALIVE_S = 10.0
SSE_KEEPALIVE = ": held back\n\n"


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(
    ctx: ServerContext,
    request: Request,
    subs: list[TokenizeRequest],
    streams: list[Stream],  # of each sub (`start_streams`)
    prompt_fields: list[str],  # of each sub: the request field its prompt came in, for errors
    stream: bool,
    include_usage: bool,
    formatter: Formatter,
    renamed: Mapping[str, str] | None = None,  # the client's names of the engine's fields
) -> Response:
    client = ctx.client
    choices = [Choice(index=i) for i in range(len(subs))]
    first_of_prompt = {i for i, sub in enumerate(subs) if sub.prefix_leader is None}
    record: AccessRecord | None = request.scope.get("state", {}).get("access")
    if record is not None:
        record.rid = formatter.response_id
        record.choices, record.prompts_counted = choices, first_of_prompt
    # A client that leaves aborts its requests, whether they wait for admission (which may
    # take long) or generate; one watcher serves both phases.
    disconnect = asyncio.create_task(wait_for_disconnect(request))
    try:
        firsts = await first_outputs(client, subs, streams, disconnect)
        if firsts is None:
            return Response(status_code=499)
        if record is not None:  # the TTFT of the metrics (engine_client.py), the last choice's
            record.first_tokens(min(out.handoff_seconds or 0.0 for out in firsts))
        for out, prompt_field in zip(firsts, prompt_fields):
            if out.finish_reason is not None and out.finish_reason.kind == "error":
                await asyncio.gather(*(s.aclose() for s in streams))
                raise APIError.of(out.finish_reason, prompt_field, renamed)
        if stream:  # the streaming response watches for the client leaving itself
            return EngineStreamResponse(
                stream_events(
                    streams,
                    firsts,
                    choices,
                    first_of_prompt,
                    include_usage,
                    formatter,
                    client.metrics.request_error,
                    end=lambda index, why: client.close(subs[index].rid, error=why),
                ),
                streams,
                media_type="text/event-stream",
            )
        if not await collect_unless_left(streams, firsts, choices, disconnect):
            return Response(status_code=499)
    finally:
        disconnect.cancel()
    failed = next(
        ((c.error, f) for c, f in zip(choices, prompt_fields) if c.error is not None), None
    )
    if failed is not None:  # a request that failed after it started is no 200
        raise APIError.of(*failed, renamed)
    return JSONResponse(formatter.final(choices, usage(choices, first_of_prompt)))


async def first_outputs(
    client: EngineClient,
    subs: list[TokenizeRequest],
    streams: list[Stream],
    disconnect: asyncio.Task[None],
) -> list[TextOutput] | None:
    """The first output of every stream, or None if the client left before they all came;
    the requests are closed then, and when this fails."""
    firsts = asyncio.ensure_future(asyncio.gather(*(anext(s) for s in streams)))
    try:
        racing: list[asyncio.Future[Any]] = [firsts, disconnect]
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if firsts.done():
            return firsts.result()
    except BaseException:
        await _close_all(client, subs, firsts)
        raise
    await _close_all(client, subs, firsts)
    return None


async def _close_all(
    client: EngineClient, subs: list[TokenizeRequest], firsts: asyncio.Future[Any]
) -> None:
    firsts.cancel()
    await asyncio.gather(firsts, return_exceptions=True)
    await asyncio.gather(*(client.close(sub.rid) for sub in subs))


async def collect_unless_left(
    streams: list[Stream],
    firsts: list[TextOutput],
    choices: list[Choice],
    disconnect: asyncio.Task[None],
) -> bool:
    """Every output of every stream into its choice; False if the client left first (closing
    the streams then aborts the requests)."""
    collect = asyncio.create_task(collect_all(streams, firsts, choices))
    try:
        await asyncio.wait([collect, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not collect.done():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
    if collect.cancelled():
        return False
    collect.result()
    return True


async def collect_all(
    streams: list[Stream], firsts: list[TextOutput], choices: list[Choice]
) -> None:
    async def one(stream: Stream, first: TextOutput, choice: Choice) -> None:
        choice.add(first)
        try:
            async for out in stream:
                choice.add(out)
        finally:
            await stream.aclose()

    await asyncio.gather(*(one(s, f, c) for s, f, c in zip(streams, firsts, choices)))


async def stream_events(
    streams: list[Stream],
    firsts: list[TextOutput],  # of each stream, read already (`first_outputs`)
    choices: list[Choice],
    first_of_prompt: set[int],
    include_usage: bool,
    formatter: Formatter,
    on_error: Callable[[int], None],  # counts an error event's status (the answer's was 200)
    *,
    end: Callable[[int, str], Awaitable[None]],
) -> AsyncGenerator[str, None]:
    """`end(index, why)`: aborts a choice's request that the server itself ends, before its
    stream is closed (which would abort it as a client that left): no default, for a caller
    without one would count such an end as a client's abort."""
    queue: asyncio.Queue[tuple[int, TextOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream: Stream, first: TextOutput) -> None:
        try:
            queue.put_nowait((index, first))
            async for out in stream:
                queue.put_nowait((index, out))
        finally:
            await stream.aclose()
            queue.put_nowait((index, None))

    def event(chunk: dict) -> str:
        # OpenAI's include_usage: every chunk before the usage chunk has the field, null
        return sse({**chunk, "usage": None} if include_usage else chunk)

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        for start in formatter.stream_start(len(choices)):
            yield event(start)
        remaining = len(tasks)
        last_sent = time.monotonic()
        failed: set[int] = set()  # choices whose chunk could not be made: ended, their rest dropped
        while remaining:
            index, out = await queue.get()
            if out is None:
                remaining -= 1
                continue
            if index in failed:
                continue
            choice = choices[index]
            choice.add(out)
            if out.finish_reason is not None and out.finish_reason.kind == "error":
                on_error(out.finish_reason.status)  # the answer's status was 200: counted here
                yield sse(APIError.of(out.finish_reason).body())
                continue
            try:
                chunk = formatter.chunk(choice, out)
            except Exception as exc:  # a bug: an error event ends the choice, not a cut connection
                logger.exception("a chunk of %s failed", formatter.response_id)
                on_error(500)
                yield sse(internal_error(exc).body())
                failed.add(index)
                # counted above: its request is ended as the server's doing, no client's abort
                await end(index, "the API server failed to send its output")
                tasks[index].cancel()  # closing its stream then has nothing left to abort
                continue
            if chunk is not None:
                yield event(chunk)
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent > HELD_STREAM_KEEPALIVE_S:
                yield SSE_KEEPALIVE
                last_sent = time.monotonic()
        if include_usage:
            yield sse(formatter.usage_chunk(usage(choices, first_of_prompt)))
        yield sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
