"""A streaming answer that ends its engine requests when it ends, however it ends.

Starlette neither closes a streaming body it stops iterating (a send cut off when the client
left) nor starts one whose client left while the headers were going out: the body's engine
streams would then stay open until the garbage collector found them, their request ids taken
and their requests generating for nobody."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EngineStreamResponse(StreamingResponse):
    def __init__(
        self,
        body: AsyncGenerator[str, None],
        engine_streams: Sequence[AsyncGenerator[Any, None]],  # what `body` reads
        media_type: str,
    ) -> None:
        super().__init__(body, media_type=media_type)
        self._body = body
        self._engine_streams = engine_streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # The body first: its own readers of the streams end (a stream another task
            # reads cannot be closed); then the streams a body never started left open.
            try:
                await self._body.aclose()
            finally:  # a close that fails (the engine's sockets closed at shutdown) ends no other
                await asyncio.gather(
                    *(stream.aclose() for stream in self._engine_streams), return_exceptions=True
                )
