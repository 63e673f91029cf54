"""The API server's side of the engine: sends requests to the tokenizer process and routes
each output back to the request that waits for it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args

import zmq
import zmq.asyncio

from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import (
    AbortRequest,
    BootstrapTarget,
    CacheFlushed,
    EngineInfo,
    FinishReason,
    FlushCache,
    RoomRefused,
    SchedulerStats,
    Shutdown,
    TextBatch,
    TextOutput,
    Tokenized,
    TokenizerCall,
    TokenizeRequest,
)
from kubesgl.engine.metrics import HANDOFF, EngineMetrics
from kubesgl.gc_pacing import GcPacer, tick_every

logger = logging.getLogger(__name__)
T = TypeVar("T")
STATS_LOG_INTERVAL_S = 10.0  # while busy, a line with the scheduler's state this often


class DuplicateRequestId(ValueError):
    pass


class EngineGone(RuntimeError):
    """The engine's processes are going away (`fail_all`): no call to them will be answered."""


@dataclass
class _Pending:
    queue: asyncio.Queue[TextOutput] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    first_token: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    handed_off: bool = False  # a prefill engine's room: its KV went to the decode engine
    sent: bool = False  # the request reached the tokenizer
    finished: bool = False  # its final output arrived
    closed: bool = False  # its reader left before the end; aborted, its end still to come
    probe: bool = False  # a health check (/health_generate): no user's request, in no metric
    room: int | None = None  # its bootstrap room, a prefill or decode engine's request


class EngineClient:
    def __init__(
        self, endpoints: Endpoints, metrics: EngineMetrics, gc_pacer: GcPacer | None = None
    ):
        """`gc_pacer`: the serving process's (kubesgl/gc_pacing.py), started once the engine
        is ready; None leaves the garbage collector as it is (tests in one process)."""
        self.endpoints = endpoints
        self.metrics = metrics
        self.gc_pacer = gc_pacer
        self._pacing: asyncio.Task | None = None
        self.info: EngineInfo | None = None
        self.stats: SchedulerStats | None = None  # the scheduler's latest
        self.ready = asyncio.Event()
        self.heard_at = time.monotonic()  # the last message from the engine's processes
        self._pending: dict[str, _Pending] = {}
        self._flushes: dict[int, asyncio.Future[bool]] = {}
        self._flush_ids = itertools.count()
        self._tokenizer_calls: dict[int, asyncio.Future[Tokenized]] = {}
        self._tokenizer_call_ids = itertools.count()
        self._failure: str | None = None  # why the engine's processes went away
        self._context = zmq.asyncio.Context()
        self._to_tokenizer = push(self._context, endpoints.tokenizer_in)
        self._from_detokenizer = pull(self._context, endpoints.api_in)
        self._reader: asyncio.Task | None = None
        self._shutdown_sent = False
        self._closing: asyncio.Future[None] | None = None  # aclose's work, done once
        self.reader_failure: str | None = None  # why the reader of outputs ended, if it failed
        self.stats_log_interval_s = STATS_LOG_INTERVAL_S
        self._stats_logged_at = time.perf_counter()
        self._tokens_since_log = 0
        self._prompt_tokens_logged = 0  # the scheduler's count of new prompt tokens, last line

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stops reading and closes the sockets (not the requests' `close`). A context the
        garbage collector finds with sockets open hangs it: pyzmq's term() waits for them. Done
        once: a later or concurrent call waits for the first (a second term() of the context,
        while the first waits, never returns)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        tasks = self._stop_tasks()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._from_detokenizer.close()
        self._to_tokenizer.close()  # its linger still delivers a Shutdown just sent
        await asyncio.to_thread(self._context.term)  # which waits up to that linger

    def _stop_tasks(self) -> list[asyncio.Task]:
        tasks = [task for task in (self._reader, self._pacing) if task is not None]
        for task in tasks:
            task.cancel()  # again on a cancelled task: a no-op once it is done
        return tasks

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-outputs")
        self._reader.add_done_callback(self._reader_ended)

    def _reader_ended(self, reader: asyncio.Task) -> None:
        """Nothing awaits the reader, and without it no request ever ends: its exception is
        logged and kept for the launcher's child watch, which takes the server down."""
        if reader.cancelled() or reader.exception() is None:  # cancelled: shutdown
            return
        error = reader.exception()
        logger.error("the reader of the engine's outputs failed", exc_info=error)
        self.reader_failure = f"the API server's reader of engine outputs failed: {error!r}"

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def user_requests(self) -> int:
        """Requests in flight but health probes, which are no user's work."""
        return sum(not pending.probe for pending in self._pending.values())

    async def _read_outputs(self) -> None:
        while True:
            message = await self._from_detokenizer.recv_pyobj()
            self.heard_at = time.monotonic()
            handler = _HANDLERS.get(type(message))
            if handler is None:  # a fault of the engine's own processes, never a client's
                raise TypeError(f"not a message for the API server: {message!r}")
            handler(self, message)

    def _ready(self, message: EngineInfo) -> None:
        self.info = message
        self.ready.set()
        if self.gc_pacer is not None and self._pacing is None:
            self.gc_pacer.start()  # start-up is over: what is alive now stays
            self._pacing = asyncio.create_task(
                tick_every(self.gc_pacer, lambda: self.in_flight > 0), name="gc-pacing"
            )
        logger.info(
            "engine ready: context %d, KV pool %d tokens",
            message.context_length,
            message.max_total_tokens,
        )

    def _flushed(self, message: CacheFlushed) -> None:
        _answer(self._flushes, message.flush_id, message.flushed)

    def _tokenized(self, message: Tokenized) -> None:
        _answer(self._tokenizer_calls, message.call_id, message)

    def _outputs_arrived(self, message: TextBatch) -> None:
        if message.stats is not None:
            self.stats = message.stats
            self.metrics.update_scheduler(message.stats)
            self._log_stats(message.stats)
        for out in message.outputs:
            pending = self._pending.get(out.rid)
            if pending is None:
                continue
            if pending.closed:  # no reader: only its end matters, which frees its id
                if out.finish_reason is not None:
                    del self._pending[out.rid]
                continue
            self._account(pending, out)
            pending.queue.put_nowait(out)

    def _account(self, pending: _Pending, out: TextOutput) -> None:
        now = time.perf_counter()
        pending.prompt_tokens, pending.cached_tokens = out.prompt_tokens, out.cached_tokens
        pending.finished = out.finish_reason is not None
        if pending.probe:
            return
        if out.queue_seconds is not None and out.prefill_seconds is not None:
            self.metrics.scheduled(out.queue_seconds, out.prefill_seconds)
        if out.token_ids:
            last = pending.last_token
            since_last = now - (pending.arrival if last is None else last)
            if last is None and out.handoff_seconds is not None:
                # a prefill engine's answer: the wait for the decode engine's slots (before its
                # prompt) and the KV write (after it) are left out of its TTFT
                self.metrics.handed_off(max(0.0, since_last - out.handoff_seconds))
                pending.handed_off = True
            else:
                self.metrics.tokens(len(out.token_ids), since_last, last is None)
                self._tokens_since_log += len(out.token_ids)
            pending.last_token = now
            pending.first_token = pending.first_token or now
            pending.output_tokens += len(out.token_ids)
        if out.finish_reason is not None and out.finish_reason.kind != "error":
            self._finished(pending, out.finish_reason.kind, now)

    def _finished(self, pending: _Pending, finish_reason: str, now: float) -> None:
        if pending.probe:  # its abort too (a probe that timed out)
            return
        decode = None if pending.first_token is None else now - pending.first_token
        if pending.handed_off:  # it did not finish here: its decode engine counts how it ends
            finish_reason, decode = HANDOFF, None
        self.metrics.finished(
            now - pending.arrival,
            finish_reason,
            pending.prompt_tokens,
            pending.cached_tokens,
            pending.output_tokens,
            decode,
        )

    def _log_stats(self, stats: SchedulerStats) -> None:
        """Every stats_log_interval_s while requests run or wait: running, waiting, KV usage,
        and per second since the last line the new prompt tokens admitted to prefill (those not
        found in the prefix cache: a prefill engine's work) and the tokens generated."""
        now = time.perf_counter()
        elapsed = now - self._stats_logged_at
        if elapsed < self.stats_log_interval_s:
            return
        prompt_tokens = stats.prompt_tokens - stats.cached_prompt_tokens  # since start
        if stats.num_running or stats.num_waiting:
            logger.info(
                "busy: running=%d waiting=%d kv_usage=%.2f prompt=%.1f tok/s generated=%.1f tok/s "
                "in_flight=%d",
                stats.num_running,
                stats.num_waiting,
                stats.kv_used_tokens / max(stats.kv_total_tokens, 1),
                # never negative: a benchmark's engine.reset() zeroes the scheduler's counters
                max(prompt_tokens - self._prompt_tokens_logged, 0) / elapsed,
                self._tokens_since_log / elapsed,
                len(self._pending),
            )
        self._stats_logged_at, self._tokens_since_log = now, 0
        self._prompt_tokens_logged = prompt_tokens

    def generate(self, request: TokenizeRequest) -> AsyncGenerator[TextOutput, None]:
        """Outputs of one request until it finishes. The request id is taken at once (a
        duplicate raises DuplicateRequestId, an engine gone EngineGone); leaving early, or
        `close`, aborts the request.
        A probe (`request.probe`, a health check) is left out of the request metrics (as
        SGLang's log_metrics=False does): probes every few seconds would skew them and
        autoscaling."""
        if self._failure is not None:  # no output would ever come
            raise EngineGone(self._failure)
        taken = self._pending.get(request.rid)
        if taken is not None:
            raise DuplicateRequestId(
                f"request id {request.rid!r} is still ending (its client left); retry shortly"
                if taken.closed
                else f"request id {request.rid!r} is already in use"
            )
        room = None if request.bootstrap is None else request.bootstrap.room
        pending = self._pending[request.rid] = _Pending(probe=request.probe, room=room)
        return self._outputs(request, pending)

    async def _outputs(
        self, request: TokenizeRequest, pending: _Pending
    ) -> AsyncGenerator[TextOutput, None]:
        try:
            await self._to_tokenizer.send_pyobj(request)
            pending.sent = True
            while True:  # up to the final output, which the reader may have queued behind others
                out = await pending.queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            await self.close(request.rid)

    async def close(self, rid: str, error: str | None = None) -> None:
        """Forget a request; one still running is aborted. Its id stays taken until the
        engine's last output for it arrives: a request that reused the id sooner would get
        that output, and the tokenizer would drop its state. `error`: why the server ended it
        itself, which its caller counts as an error answer, so it is no client's abort in
        kubesgl_requests_total (as a request that ends with finish_reason "error"); None: its
        client left, an abort."""
        pending = self._pending.get(rid)
        if pending is None or pending.closed:
            return
        if pending.finished or not pending.sent:
            del self._pending[rid]
            return
        pending.closed = True
        await self.abort(rid, error or "the client disconnected")
        if error is None:
            self._finished(pending, "abort", time.perf_counter())

    async def abort(self, rid: str, message: str) -> None:
        await self._to_tokenizer.send_pyobj(AbortRequest(rid, message))

    async def refuse_rooms(self, targets: list[BootstrapTarget], message: str, status: int) -> None:
        """Requests for the rooms of `targets` were refused before they reached the engine,
        answered `status` and `message`: the engine's role ends the rooms (RoomRefused), but
        those of requests in flight here. Such a room is its live request's (a retry with the
        same rid and room is refused as a duplicate), which may not have been sent yet: the
        scheduler, which leaves a room alone once its request is there, would end it first."""
        held = {pending.room for pending in self._pending.values()}
        for target in targets:
            if target.room not in held:
                await self._to_tokenizer.send_pyobj(RoomRefused(target, message, status))

    async def flush_cache(self) -> bool:
        """Whether the scheduler emptied its prefix cache (it does only when idle)."""
        return await self._ask(self._flushes, self._flush_ids, FlushCache)

    async def tokenizer_call(
        self, prompt: TokenizeRequest | None = None, token_ids: list[int] | None = None
    ) -> Tokenized:
        """The tokenizer process's tokens of `prompt` (/tokenize) or text of `token_ids`
        (/detokenize). It tokenizes requests anyway: asked there, the tokens are a generation
        request's own (one tokenizer, one rendering of the chat template), and the API server
        loads no second tokenizer, whose work would hold up its event loop."""
        return await self._ask(
            self._tokenizer_calls,
            self._tokenizer_call_ids,
            lambda call_id: TokenizerCall(call_id, prompt, token_ids),
        )

    async def _ask(
        self,
        calls: dict[int, asyncio.Future[T]],
        ids: Iterator[int],
        message: Callable[[int], object],
    ) -> T:
        """Sends `message(call_id)` down the pipeline and waits for the answer that the reader
        of outputs files under its id in `calls`."""
        if self._failure is not None:
            raise EngineGone(self._failure)
        call_id = next(ids)
        answer = calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self._to_tokenizer.send_pyobj(message(call_id))
            return await answer
        finally:
            calls.pop(call_id, None)

    @property
    def failure(self) -> str | None:
        """Why the engine's processes went away (`fail_all`), or None while they run."""
        return self._failure

    def fail_all(self, message: str) -> None:
        """End every request in flight with a 500: the engine's processes are going away and
        no answer will come (a child process died, or hung). Not a 503, which says the request
        was refused before any work and may go to another engine: one in flight may be the
        request that broke this one."""
        self._failure = message
        reason = FinishReason("error", message=message, status=500)
        calls: list[asyncio.Future[Any]] = [
            *self._flushes.values(),
            *self._tokenizer_calls.values(),
        ]
        for call in calls:
            if not call.done():
                call.set_exception(EngineGone(message))
        for rid, pending in list(self._pending.items()):
            if pending.closed:
                del self._pending[rid]
            elif not pending.finished:
                pending.finished = True
                pending.queue.put_nowait(
                    TextOutput(
                        rid,
                        "",
                        [],
                        reason,
                        pending.prompt_tokens,
                        pending.cached_tokens,
                        pending.output_tokens,
                    )
                )

    async def abort_all(self, message: str) -> None:
        for rid in list(self._pending):
            await self.abort(rid, message)

    async def shutdown(self) -> None:
        """Asks the engine's processes to stop, and stops reading their outputs. The Shutdown
        goes once, and only before `aclose`, which closes its socket."""
        if not self._shutdown_sent and self._closing is None:
            self._shutdown_sent = True
            await self._to_tokenizer.send_pyobj(Shutdown())
        self._stop_tasks()

    @staticmethod
    def new_rid(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


# What the detokenizer sends the API server (the scheduler's EngineInfo and CacheFlushed it
# passes on), and how each changes the client: every member has its handler.
FromEngine = EngineInfo | CacheFlushed | Tokenized | TextBatch
_HANDLERS: dict[type, Callable[[EngineClient, Any], None]] = {
    EngineInfo: EngineClient._ready,
    CacheFlushed: EngineClient._flushed,
    Tokenized: EngineClient._tokenized,
    TextBatch: EngineClient._outputs_arrived,
}
assert set(_HANDLERS) == set(get_args(FromEngine))


def _answer(calls: dict[int, asyncio.Future[T]], call_id: int, result: T) -> None:
    call = calls.pop(call_id, None)
    if call is not None and not call.done():  # None: its caller gave up
        call.set_result(result)
