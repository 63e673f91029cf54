"""A worker's 503, passed on after the retries, tells the client when to try again as the worker
said: the router's own `Retry-After: 1` replaced an engine's longer wait (a drain's end, say),
and clients that honour it (OpenAI's SDKs) came back too soon."""

from __future__ import annotations

import asyncio
import json

import pytest

from kubesgl.router.app import _error_reply
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.upstream import UpstreamClient, UpstreamError
from kubesgl.router.workers import Role, WorkerRegistry


class _Busy:
    status = 503

    def __init__(self, retry_after: bytes | None) -> None:
        self.raw_headers = [(b"content-type", b"application/json")]
        if retry_after is not None:
            self.raw_headers.append((b"Retry-After", retry_after))

    async def read(self) -> bytes:
        return json.dumps({"error": {"message": "the request queue is full"}}).encode()

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Session:
    def __init__(self, retry_after: bytes | None) -> None:
        self.retry_after = retry_after

    async def request(self, method, url, data, headers, **kwargs):
        return _Busy(self.retry_after)


def _passed_on(retry_after: bytes | None) -> bytes:
    """The Retry-After a client gets for a worker's 503 that carried `retry_after`."""
    workers = WorkerRegistry()
    worker = workers.add("http://w:1", Role.MIXED)
    client = UpstreamClient(_Session(retry_after), RouterMetrics(workers))  # type: ignore[arg-type]

    async def send() -> UpstreamError:
        with pytest.raises(UpstreamError) as caught:
            await client.exchange(worker, "POST", "/v1/completions", b"{}", [], stream=False)
        return caught.value

    reply = _error_reply(asyncio.run(send()))
    assert reply.status == 503
    [value] = [v for k, v in reply.headers if k == b"retry-after"]
    return value


@pytest.mark.parametrize(
    "sent", [b"120", b" 0 ", b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed Oct 21 07:28:00 2015"]
)
def test_a_workers_valid_retry_after_is_passed_on(sent):
    assert _passed_on(sent) == sent.strip()


@pytest.mark.parametrize("sent", [None, b"", b"soon", b"-1", b"1.5", b"\xb2", b"21 Oct 2015"])
def test_without_a_valid_retry_after_the_router_says_one_second(sent):
    assert _passed_on(sent) == b"1"
