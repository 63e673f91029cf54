"""Stand-ins for the aiohttp objects UpstreamClient reads, for tests that fake a worker's
session: an answer given at once, and the answer to a room's cancel."""

from __future__ import annotations

import json


class Content:
    def __init__(self, body: bytes) -> None:
        self.body = body

    async def iter_any(self):
        yield self.body


class Answer:
    """A worker's response: `status` and `body`, whole at once (read or streamed)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.raw_headers = [(b"content-type", b"application/json")]
        self._body = body
        self.content = Content(body)

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def error_answer(status: int, message: str) -> Answer:
    return Answer(status, json.dumps({"error": {"message": message}}).encode())


class Cancelled:
    """The answer to the router's cancel of a room."""

    status = 200

    async def __aenter__(self) -> Cancelled:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass
