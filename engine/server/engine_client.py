"""The API server's side of the engine: sends requests to the tokenizer process and routes
each output back to the request that waits for it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kubesgl.engine.io import (
    AbortRequest,
    EngineInfo,
    Shutdown,
    TextBatch,
    TextOutput,
    TokenizeRequest,
)
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server.ipc import Endpoints, pull, push

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    queue: asyncio.Queue[TextOutput] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class EngineClient:
    def __init__(self, endpoints: Endpoints, metrics: EngineMetrics):
        self.endpoints = endpoints
        self.metrics = metrics
        self.info: EngineInfo | None = None
        self.ready = asyncio.Event()
        self._pending: dict[str, _Pending] = {}
        self._context = zmq.asyncio.Context()
        self._to_tokenizer = push(self._context, endpoints.tokenizer_in)
        self._from_detokenizer = pull(self._context, endpoints.api_in)
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-outputs")

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def _read_outputs(self) -> None:
        while True:
            message = await self._from_detokenizer.recv_pyobj()
            if isinstance(message, EngineInfo):
                self.info = message
                self.ready.set()
                logger.info("engine ready: context %d, KV pool %d tokens", message.context_length,
                            message.max_total_tokens)
                continue
            assert isinstance(message, TextBatch)
            if message.stats is not None:
                self.metrics.update_scheduler(message.stats)
            for out in message.outputs:
                pending = self._pending.get(out.rid)
                if pending is not None:
                    self._account(pending, out)
                    pending.queue.put_nowait(out)

    def _account(self, pending: _Pending, out: TextOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            first = pending.last_token is None
            self.metrics.tokens(len(out.token_ids), now - (pending.arrival if first else pending.last_token), first)
            pending.last_token = now
        if out.finish_reason is not None and out.finish_reason.kind != "error":
            self.metrics.finished(now - pending.arrival, out.finish_reason.kind, out.prompt_tokens)

    async def generate(self, request: TokenizeRequest) -> AsyncIterator[TextOutput]:
        """Outputs of one request until it finishes. Leaving early (the client went away,
        or the caller stopped reading) aborts the request in the engine."""
        pending = self._pending[request.rid] = _Pending()
        finished = False
        try:
            await self._to_tokenizer.send_pyobj(request)
            while not finished:
                out = await pending.queue.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            del self._pending[request.rid]
            if not finished:
                await self.abort(request.rid, "the client disconnected")

    async def abort(self, rid: str, message: str) -> None:
        await self._to_tokenizer.send_pyobj(AbortRequest(rid, message))

    async def abort_all(self, message: str) -> None:
        for rid in list(self._pending):
            await self.abort(rid, message)

    async def shutdown(self) -> None:
        await self._to_tokenizer.send_pyobj(Shutdown())
        if self._reader is not None:
            self._reader.cancel()

    @staticmethod
    def new_rid(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"
