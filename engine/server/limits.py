"""What one request may ask of the server, so that none holds up the others (docs/server.md,
Limits): the size of its body, how many sequences it asks for, the length of its stop strings
and of its prompts. Each limit is an engine option (engine/config.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.sampling_params import (
    CONTEXT_LENGTH_EXCEEDED,
    InvalidRequestError,
    SamplingParams,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# After a 413, what is left of the body is read and dropped for at most this long (and this
# many bytes), so that a client still sending it gets the answer instead of a reset connection.
_DRAIN_SECONDS = 5.0
_DRAIN_BYTES = 64 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 with OpenAI's error
    body. A Content-Length over the limit is refused before the body is read; a body without
    one (chunked) is read up to the limit, then refused."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:  # the HTTP server delivers no more than that
            if declared > self.limit:
                await self._refuse(receive, send, f"{declared} bytes")
            else:
                await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(receive, send, f"more than {self.limit} bytes")
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, size: str) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"the request body is {size}; this server takes at most {self.limit} bytes "
                    "(--max-request-body-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        await _drain(receive)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses such a request before it gets here
    return None


async def _drain(receive: Receive) -> None:
    """Reads what the client still sends of a refused body, up to a bound."""
    read = 0
    try:
        async with asyncio.timeout(_DRAIN_SECONDS):
            while read < _DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                read += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        pass


def check_sequences(config: EngineConfig, prompts: int, n: int) -> None:
    """A request asks for `prompts` x `n` sequences; each one is a request of the scheduler's."""
    limit = config.max_sequences_per_request
    if prompts * n > limit:
        asked = f"{prompts} prompts x n={n} = {prompts * n}" if prompts > 1 else f"n={n}"
        raise InvalidRequestError(
            f"this request asks for {asked} sequences; this server takes at most {limit} "
            "per request (--max-sequences-per-request)",
            param="n" if n > 1 else "prompt",
        )


def check_stop_strings(config: EngineConfig, params: SamplingParams) -> None:
    limit = config.max_stop_string_length
    longest = max(params.stop, key=len, default="")
    if len(longest) > limit:
        raise InvalidRequestError(
            f"stop strings may be at most {limit} characters long (--max-stop-string-length); "
            f"one is {len(longest)}",
            param="stop",
        )


def check_prompt_chars(config: EngineConfig, context_length: int, chars: int, param: str) -> None:
    """Refuses, before tokenizing it, text too long to fit the context in any tokenization a
    real tokenizer makes (they average about 4 characters per token)."""
    per_token = config.max_prompt_chars_per_token
    limit = context_length * per_token
    if chars > limit:
        raise InvalidRequestError(
            f"the prompt is {chars} characters long; this model's context is {context_length} tokens, and a "
            f"prompt over {limit} characters ({per_token} per token, --max-prompt-chars-per-token) cannot fit",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
