"""The scheduler process of one tensor-parallel rank.

Rank 0 receives requests and aborts from the tokenizer and sends each step's tokens to the
detokenizer. Every rank must run the same steps in the same order, so rank 0 broadcasts
what it received, once per loop turn, to the other ranks over a gloo group of its own (not
ZMQ PUB/SUB, which drops messages sent before a subscriber has joined); the other ranks
apply exactly that and step. Random sampling stays identical across ranks because every
rank seeds torch the same way and samples from the same gathered logits.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any, get_args

import torch
import torch.distributed as dist
import zmq

from kubesgl import contract
from kubesgl.engine.child_process import exit_for_start_failure, exit_with_parent
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.link import ProcessLink
from kubesgl.engine.disagg.protocol import BootstrapFact
from kubesgl.engine.distributed import get_tp_group, init_tensor_parallel
from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import (
    HEARTBEAT_S,
    AbortRequest,
    CacheFlushed,
    CollectGarbage,
    EngineInfo,
    FinishReason,
    FlushCache,
    GenerateRequest,
    RoomRefused,
    Shutdown,
    StepOutputs,
    TokenOutput,
)
from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams
from kubesgl.engine.scheduler.engine import Engine
from kubesgl.gc_pacing import GcPacer

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # an idle rank 0 still broadcasts this often, so other ranks never time out
# How often a prefill or decode engine turns while it only waits for KV transfers: a turn
# applies what its NIXL agent received (the bootstrap process's facts wake it at once).
TRANSFER_POLL_MS = 2
# A step that fails ends its own requests and the engine serves on; this many in a row mean the
# engine is broken, not one request: the process exits and the server with it.
MAX_FAILED_STEPS = 3

# What each turn's broadcast brings every rank to apply: the tokenizer's messages for the
# scheduler and rank 0's CollectGarbage. Shutdown comes the same way but ends the loop
# instead (run); the bootstrap process's facts stop at rank 0's link (_receive).
SchedulerMessage = GenerateRequest | AbortRequest | RoomRefused | FlushCache | CollectGarbage


def run_scheduler(
    config: EngineConfig,
    rank: int,
    endpoints: Endpoints,
    dist_init_method: str,
    log_level: str,
    bootstrap_host: str,
    sampling_seed: int,
) -> None:
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s scheduler[{rank}] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when to stop
    exit_with_parent()
    try:
        on_gpu = config.device in ("auto", "cuda") and torch.cuda.is_available()
        if on_gpu:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_tensor_parallel(
            rank, config.tp_size, dist_init_method, backend="nccl" if on_gpu else "gloo"
        )
        torch.manual_seed(sampling_seed)  # of requests without a seed (launcher.Server)
        context = zmq.Context()
        link = None
        if rank == 0 and config.role != contract.MIXED:
            link = ProcessLink(push(context, endpoints.bootstrap_in))
        engine = Engine(config, bootstrap_host, link)
        _warm_up(engine)
    except Exception as exc:  # what the server could not check before starting this process
        exit_for_start_failure(endpoints, f"scheduler rank {rank}", exc)
    gc_pacer = GcPacer()
    gc_pacer.start()
    loop = SchedulerLoop(engine, rank, endpoints, get_tp_group().control, context, link, gc_pacer)
    loop.run()


def _warm_up(engine: Engine) -> None:
    """One tiny request through every stage, so the first real request pays no first-use
    cost (a stop string too, where the model has a tokenizer); then the cache and counters are
    cleared so metrics count real traffic only."""
    stop = ["\x00"] if engine.tokenizer is not None else []
    engine.add_request(
        GenerateRequest(
            "warmup", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True, stop=stop)
        )
    )
    while engine.has_work():
        engine.step()
    engine.scheduler.reset()


class SchedulerLoop:
    def __init__(
        self,
        engine: Engine,
        rank: int,
        endpoints: Endpoints,
        control: dist.ProcessGroup | None,
        context: zmq.Context,
        link: ProcessLink | None,
        gc_pacer: GcPacer | None = None,
    ):
        self.engine = engine
        self.gc_pacer = gc_pacer
        self.rank = rank
        self.control = control
        self.context = context
        self.link = link  # rank 0 of a prefill or decode engine: what the bootstrap process learned comes in here
        self.failed_steps = 0  # in a row
        if rank == 0:
            self.inbox = pull(self.context, endpoints.scheduler_in)
            self.outbox = push(self.context, endpoints.detokenizer_in)
            self.outbox.send_pyobj(
                EngineInfo(
                    model_path=engine.config.model,
                    context_length=engine.context_length,
                    vocab_size=engine.model_config.vocab_size,
                    max_total_tokens=engine.scheduler.stats().kv_total_tokens,
                    tp_size=engine.config.tp_size,
                    architecture=engine.model_config.architecture,
                    eos_token_ids=sorted(engine.model_config.eos_token_ids),
                    kv_layout=engine.kv_layout,
                )
            )

    def _receive(self) -> list[SchedulerMessage | Shutdown]:
        """Rank 0: what arrived since the last turn (waits while idle). Others: rank 0's list."""
        messages: list[SchedulerMessage | Shutdown] = []
        if self.rank == 0:
            # sleep until a message arrives or it is time to turn: while idle, and while what is
            # queued waits for an event (memory; a prefill engine's rooms, for their decode slots)
            scheduler = self.engine.scheduler
            if not scheduler.has_steps() or scheduler.waits_for_events:
                self.inbox.poll(self._idle_poll_ms())
            while self.inbox.poll(0):
                message = self.inbox.recv_pyobj()
                if isinstance(message, BootstrapFact):
                    assert self.link is not None  # only P/D engines have a bootstrap process
                    # rank 0's own: the KV transfers share it with every rank
                    self.link.deliver(message)
                else:
                    messages.append(message)
            busy = self.engine.has_work() or bool(messages)
            if self.gc_pacer is not None and self.gc_pacer.due(busy):
                messages.append(CollectGarbage())  # rank 0 decides: every rank collects now
        if self.control is not None:
            box = [messages]
            dist.broadcast_object_list(box, src=0, group=self.control)
            messages = box[0]
        return messages

    def _idle_poll_ms(self) -> int:
        return TRANSFER_POLL_MS if self.engine.scheduler.has_work() else IDLE_POLL_MS

    def run(self) -> None:
        last_stats, last_sent = None, time.monotonic()
        while True:
            outputs: list[TokenOutput] = []
            for message in self._receive():
                if isinstance(message, Shutdown):
                    logger.info("shutting down")
                    self.engine.shutdown()
                    return
                outputs += self._apply(message)
            # a role that transfers KV polls its transfers every turn, idle or not
            if self.engine.has_work() or self.engine.role.transfers_kv:
                outputs += self._step()
            if self.rank == 0:
                stats = self.engine.scheduler.stats()
                # gauges must follow releases that emit nothing; histogram samples go out once
                now = time.monotonic()
                if (
                    outputs
                    or stats != last_stats
                    or stats.has_samples()
                    or now - last_sent >= HEARTBEAT_S / 2  # idle turns are ~1 s apart: each sends
                ):
                    self.outbox.send_pyobj(StepOutputs(outputs, stats))
                    last_stats, last_sent = stats, now

    def _step(self) -> list[TokenOutput]:
        """A step whose requests the scheduler ended with a 500 for its error (handed out next
        turn) does not take the others down: the engine serves on. Any other error ends the
        process, as does one where going on is unsafe: with several ranks (they could part
        ways), when the device no longer answers, or at MAX_FAILED_STEPS in a row."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failed_steps += 1
            contained = exc is self.engine.scheduler.contained_failure
            if (
                not contained
                or self.engine.config.tp_size > 1
                or self.failed_steps >= MAX_FAILED_STEPS
            ):
                raise
            self.engine.check_device()
            logger.exception("a step failed: its requests end with an error, the engine serves on")
            return []
        self.failed_steps = 0
        return outputs

    def _apply(self, message: SchedulerMessage) -> list[TokenOutput]:
        handler = _HANDLERS.get(type(message))
        if handler is None:  # a fault of the engine's own processes, never a client's
            raise TypeError(f"not a message for the scheduler: {message!r}")
        return handler(self, message)

    def _collect_garbage(self, message: CollectGarbage) -> list[TokenOutput]:
        assert self.gc_pacer is not None  # rank 0 sends it only with a pacer
        self.gc_pacer.collect()
        return []

    def _abort(self, message: AbortRequest) -> list[TokenOutput]:
        return self.engine.abort_request(message.rid, message.message)

    def _refuse_room(self, message: RoomRefused) -> list[TokenOutput]:
        self.engine.role.refused(message.target, message.message, message.status)
        return []

    def _flush_cache(self, message: FlushCache) -> list[TokenOutput]:
        busy = self.engine.has_work()
        if busy:
            logger.info("not flushing the prefix cache: requests are running")
        else:
            self.engine.scheduler.reset()
            logger.info("prefix cache flushed")
        if self.rank == 0:
            self.outbox.send_pyobj(CacheFlushed(message.flush_id, not busy))
        return []

    def _admit(self, message: GenerateRequest) -> list[TokenOutput]:
        """Adds the request; one the engine refuses or fails to add ends at once, with its
        error, and the others go on."""
        try:
            self.engine.add_request(message)
        except InvalidRequestError as exc:
            reason = FinishReason(
                "error", message=str(exc), param=exc.param, status=exc.status, code=exc.code
            )
        except Exception as exc:  # one request's fault must not stop the others
            logger.exception("admitting request %s failed", message.rid)
            reason = FinishReason(
                "error",
                message=f"internal error admitting the request: {type(exc).__name__}: {exc}",
                status=500,
            )
        else:
            return []
        return [
            TokenOutput(
                rid=message.rid,
                token_ids=[],
                finish_reason=reason,
                prompt_tokens=len(message.input_ids),
            )
        ]


# How each message a turn applies changes the engine: every member of SchedulerMessage has its
# handler, which returns the outputs it ends at once, if any.
_HANDLERS: dict[type, Callable[[SchedulerLoop, Any], list[TokenOutput]]] = {
    GenerateRequest: SchedulerLoop._admit,
    AbortRequest: SchedulerLoop._abort,
    RoomRefused: SchedulerLoop._refuse_room,
    FlushCache: SchedulerLoop._flush_cache,
    CollectGarbage: SchedulerLoop._collect_garbage,
}
assert set(_HANDLERS) == set(get_args(SchedulerMessage))
