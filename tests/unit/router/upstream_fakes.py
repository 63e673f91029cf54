"""Stand-ins for the aiohttp objects UpstreamClient reads, for tests that fake a worker's
session: an answer given at once, and the answer to a room's cancel; and an UpstreamClient
stand-in that records what each worker got, with the round-robin Forwarder over it."""

from __future__ import annotations

import asyncio
import json

from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.policies import RoundRobinPolicy
from kubesgl.router.routing import DisaggregationSettings, Forwarder, Policies, RetrySettings
from kubesgl.router.upstream import BufferedReply, ConnectionSlots, UpstreamError
from kubesgl.router.workers import Role, Worker, WorkerRegistry

LONG_PROMPT = "word " * 400  # ~500 tokens: handed over whenever a prefill worker can take it


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


class RecordingUpstream:
    """Answers every request 200, except a prefill worker's while `prefill_refuses` (a 503
    before any work), which comes before its decode partner's answer; records which worker
    got which body."""

    def __init__(self) -> None:
        self.sent: list[tuple[Worker, dict[str, object]]] = []
        self.prefill_refuses = False
        self.slots = ConnectionSlots(None, 0)

    async def exchange(
        self, worker, method, path, payload, headers, *, stream, paired=False, slot=None, trial=None
    ):
        self.sent.append((worker, json.loads(payload)))
        if paired and worker.role is Role.DECODE:
            await asyncio.sleep(0.05)
        if worker.role is Role.PREFILL and self.prefill_refuses:
            raise UpstreamError(worker, 503, "draining", retryable=True, answered=True)
        return BufferedReply(200, [], b"{}")

    async def drain(self, worker, path, payload, headers, *, paired=False, **_):
        await self.exchange(worker, "POST", path, payload, headers, stream=False)


def round_robin_forwarder(registry: WorkerRegistry, upstream: RecordingUpstream) -> Forwarder:
    """The registry's Forwarder over `upstream`, round robin for every role, no retry delay."""
    policies = Policies(RoundRobinPolicy(), RoundRobinPolicy(), RoundRobinPolicy())
    return Forwarder(
        registry,
        policies,
        upstream,  # type: ignore[arg-type]
        RouterMetrics(registry),
        RetrySettings(initial_backoff_s=0, max_backoff_s=0),
        DisaggregationSettings(),
    )
