"""The scheduler's state of one request."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from kubesgl.engine.kvcache.radix_cache import TreeNode
from kubesgl.engine.messages import BootstrapTarget, FinishReason, TokenLogprob
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.grammar import GrammarState


class ReqStatus(Enum):
    WAITING = auto()  # queued (or retracted and queued again), holds no resources
    PREFILLING = auto()  # prompt chunks scheduled, not all of them yet
    DECODING = auto()  # whole prompt scheduled; produces one token per step
    TRANSFERRING = auto()  # prefill role: prompt done, its KV on the way to the decode engine
    # decode role: prompt slots allocated, its KV on the way from the prefill engine
    AWAITING_KV = auto()
    FINISHED = auto()  # result sent; resources go back once no in-flight step uses them
    RELEASED = auto()


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prefix_leader: str | None = None  # see GenerateRequest.prefix_leader
    bootstrap: BootstrapTarget | None = None  # see GenerateRequest.bootstrap
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    arrived: float = field(default_factory=time.perf_counter)  # the scheduler's receipt
    admitted: float | None = None  # when it left the waiting queue
    timings_sent: bool = False  # queue and prefill seconds went out with its first output
    # A prefill engine's room: when its prompt was computed and its first token sampled (the
    # end of its prefill time and TTFT); its answer leaves later, once its KV is at the decode
    # engine
    prompt_done_at: float | None = None
    # A prefill engine's room: how long it waited for the decode engine's slots before it
    # could be admitted, the decode pool's load, which its queue time and TTFT leave out
    slots_wait: float = 0.0
    # Constrained decoding: the compilation it waits for before it is queued, then its matcher,
    # which has accepted every token of output_ids.
    grammar_compiling: Future | None = None
    grammar: GrammarState | None = None

    # KV state. slots[p] is the KV slot of position p. The first `num_cached` slots belong to
    # the radix tree (locked through `last_node`); the rest are this request's own pages.
    row: int | None = None  # row of the request-to-token table
    slots: list[int] = field(default_factory=list)
    num_cached: int = 0  # page-aligned
    # prompt tokens found in the cache at admission (the prefill engine's, for a room)
    num_prefix_hit: int = 0
    last_node: TreeNode | None = None
    reserved_pages: int = 0  # pages still promised to this request for its remaining tokens
    table_len: int = 0  # leading slots already written to the device table row
    penalties_ready: bool = False  # the row's penalty state holds this request's tokens

    # Progress. Positions [0, num_scheduled) have been scheduled into some step; the KV of
    # [0, num_computed) was written by steps whose results were processed. Prefill computes
    # the first `fill_len` tokens: the prompt, and after a retraction the outputs so far too.
    fill_len: int = -1  # -1: the prompt's length
    num_scheduled: int = 0
    num_computed: int = 0
    # A step it was part of failed: that step's KV was never written and the steps launched
    # behind it read it, so num_computed stays where the failure found it (nothing of theirs
    # reaches the prefix cache)
    kv_lost: bool = False
    outputs_scheduled: int = 0  # sampled tokens scheduled, in flight included
    future_slot: int | None = None  # where the in-flight step leaves this request's newest token
    last_step: int = -1  # the latest step this request is part of
    retractions: int = 0  # times sent back to the queue to free KV (scheduler.py)
    # params.stop_token_ids as a set: every output token is looked up in it, and a request may
    # bring hundreds of them
    stop_ids: frozenset[int] = field(init=False, repr=False)
    # the tokens that would end it (its stop tokens, EOS unless ignored), which it may not
    # sample while it has fewer than params.min_tokens outputs; set by the scheduler
    ending_ids: tuple[int, ...] = ()
    # params.logit_bias as tensors (token ids, amounts), built once: every step of the request
    # applies them, and the batch only joins its requests' (None: no bias)
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.fill_len < 0:
            self.fill_len = len(self.prompt_ids)
        self.stop_ids = frozenset(self.params.stop_token_ids)
        bias = self.params.logit_bias
        self.bias = (
            (
                torch.tensor(list(bias), dtype=torch.int64),
                torch.tensor(list(bias.values()), dtype=torch.float32),
            )
            if bias
            else None
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_tokens(self) -> int:
        """params.max_tokens, which the scheduler sets when the request arrives (the
        default where the request left it unset)."""
        assert self.params.max_tokens is not None, "the scheduler resolves max_tokens"
        return self.params.max_tokens

    @property
    def table_row(self) -> int:
        """`row`, of a request holding one (admitted, its KV not given back)."""
        assert self.row is not None, f"request {self.rid} holds no table row"
        return self.row

    @property
    def finished(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.RELEASED)

    @property
    def aborted(self) -> bool:
        """It ended as an abort: its client left, or the engine shut down."""
        return self.finish_reason is not None and self.finish_reason.kind == "abort"

    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_ids(self) -> list[int]:
        """The tokens prefill computes (see fill_len)."""
        return self.all_tokens()[: self.fill_len]

    def requeue(self) -> None:
        """Back to the queue after a retraction (its KV already given back): the next prefill
        recomputes every token known so far, and its last one samples the next output."""
        self.status = ReqStatus.WAITING
        self.fill_len = len(self.prompt_ids) + len(self.output_ids)
        self.num_scheduled = self.num_computed = self.table_len = 0
        self.future_slot, self.penalties_ready = None, False
        self.retractions += 1
