"""Continuous batching: admission, chunked prefill, decode, finishing, abort, and the
overlap of CPU scheduling with the forward pass.

With overlap on, one step is always in flight: the loop builds and launches step N+1, then
waits for step N and handles its tokens. Three rules keep that safe:
- a request decodes again only while its scheduled outputs are below max_tokens, so step
  N+1 never computes a token past the limit;
- a token from a step that ran after its request finished (or was aborted) is dropped;
- a finished request's row and pages are released only after every step it is part of has
  completed, and exactly once.

Admission reserves KV for an estimate of the outputs (admission.py). When the next decode
step needs pages nobody reserved and none are free, the step in flight is finished first
and requests are retracted (`_retract`) until it fits: their KV goes to the radix cache and
they wait again at the front of the queue; re-admitted, they prefill prompt and outputs
(mostly from the cache) and go on from the next token, as if never interrupted.

A request with a grammar samples under a mask its matcher builds from its tokens so far. With
overlap, step N+1 is launched before step N's tokens are known, so its mask is filled only
after step N is processed; the executor waits for the mask after the forward pass, before it
samples (`_fill_vocab_mask`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from kubesgl.engine.executor.model_runner import PendingStep, StepResult
from kubesgl.engine.executor.worker import OverlapExecutor, SyncExecutor
from kubesgl.engine.forward_batch import VocabMask
from kubesgl.engine.kvcache.allocator import pages_for
from kubesgl.engine.messages import (
    FinishReason,
    GenerateRequest,
    SchedulerStats,
    TokenLogprob,
    TokenOutput,
)
from kubesgl.engine.sampling_params import (
    CONTEXT_LENGTH_EXCEEDED,
    InvalidRequestError,
    SamplingParams,
    check_prompt_tokens,
)
from kubesgl.engine.scheduler.batch_builder import BatchBuilder, ScheduledBatch
from kubesgl.engine.scheduler.grammar import GrammarBackend, GrammarState, UncompilableGrammar
from kubesgl.engine.scheduler.kv_manager import KVManager
from kubesgl.engine.scheduler.request import Req, ReqStatus
from kubesgl.engine.scheduler.roles import KVArrived, KVSent, Role
from kubesgl.engine.scheduler.schedule_policy import SchedulePolicy
from kubesgl.engine.scheduler.stop_strings import StopStringChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    context_length: int
    vocab_size: int
    max_running_requests: int
    max_queued_requests: int | None  # waiting (or compiling) requests; None: no limit
    chunked_prefill_size: int  # <= 0: no chunking
    max_prefill_tokens: int
    default_max_tokens: int  # for requests that leave max_tokens unset
    schedule_policy: str  # see schedule_policy.py
    schedule_max_wait: float
    mixed_chunk: bool  # prefill chunks and the ready decodes share a step


class Scheduler:
    def __init__(
        self,
        *,
        executor: SyncExecutor | OverlapExecutor,
        kv: KVManager,
        limits: SchedulerLimits,
        eos_token_ids: frozenset[int],
        overlap: bool,
        future_capacity: int,
        stop_checker: StopStringChecker | None,
        role: Role,
        grammars: GrammarBackend | None,
        wait_for_grammars: bool,
    ):
        self.executor = executor
        self.grammars = grammars  # None: the model has no tokenizer, so no grammar can be compiled
        # Tensor parallelism: every rank must queue a request at the same step, so each waits for
        # its compilation at arrival instead of polling for it.
        self.wait_for_grammars = wait_for_grammars
        self.stop_checker = stop_checker  # None: no tokenizer, so no stop string can be matched
        self.kv = kv
        self.role = role
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.overlap = overlap
        self.builder = BatchBuilder(kv, limits.vocab_size, future_capacity)
        self.waiting: deque[Req] = deque()
        self.policy = SchedulePolicy(limits.schedule_policy, kv.radix, limits.schedule_max_wait)
        self.compiling: list[Req] = []  # waiting for their grammar, queued once it is compiled
        self.prefilling: list[Req] = []  # admitted, prompt not fully scheduled
        self.decoding: list[Req] = []
        self.finished_unreleased: list[Req] = []
        self.requests: dict[str, Req] = {}  # every request not yet released
        self._in_flight: tuple[ScheduledBatch, Future[PendingStep]] | None = None
        self._completed_step = 0
        self._prompt_tokens = self._cached_prompt_tokens = 0
        self._retractions = 0
        self._drained: list[TokenOutput] = []  # outputs of a step finished early to retract
        # The latest error of a step whose requests were ended for it (_fail_requests): a
        # serving engine may go on after that error, not after others (process.py)
        self.contained_failure: BaseException | None = None
        self._turn_ran_nothing = False  # see `waits_for_events`

    # -- input -------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request; raises InvalidRequestError (naming the problem) if it cannot run."""
        try:
            self.validate(request)
        except InvalidRequestError as exc:
            if request.bootstrap is not None:
                self.role.refused(request.bootstrap, str(exc), exc.status)
            raise
        params = dataclasses.replace(request.params, max_tokens=self._max_tokens(request))
        req = Req(
            rid=request.rid,
            prompt_ids=list(request.input_ids),
            params=params,
            prefix_leader=request.prefix_leader,
            bootstrap=request.bootstrap,
        )
        if params.min_tokens:
            req.ending_ids = tuple(sorted(self._ending_ids(params)))
        if params.grammar is not None:  # before the request is anywhere: this may raise
            assert self.grammars is not None  # validate() refuses grammars without a backend
            req.grammar_compiling = self.grammars.compile(params.grammar)
        self.requests[req.rid] = req
        self.role.accept(req)
        if req.grammar_compiling is None:
            self.waiting.append(req)
            return
        if self.wait_for_grammars:
            req.grammar_compiling.exception()  # blocks; the outcome is handled by the next step
        self.compiling.append(req)  # queued by the next step that finds its grammar compiled

    def _queue_compiled(self) -> list[TokenOutput]:
        """Queue the requests whose grammar is compiled; end those whose grammar cannot be."""
        outputs: list[TokenOutput] = []
        compiling, self.compiling = self.compiling, []  # ending one removes it from self.compiling
        still = []
        for req in compiling:
            future = req.grammar_compiling
            assert future is not None  # set before the request joined self.compiling
            if not future.done():
                still.append(req)
                continue
            req.grammar_compiling = None
            if (error := future.exception()) is not None:
                if isinstance(error, UncompilableGrammar):  # in the words of this request
                    assert req.params.grammar is not None  # it has a grammar to compile
                    error = error.refusal(req.params.grammar)
                param = getattr(error, "param", None)
                status = getattr(error, "status", 500)
                req.finish_reason = FinishReason(
                    "error", message=str(error), param=param, status=status
                )
                self._finish(req)
                outputs.append(self._output(req, [], None))
                continue
            req.grammar = GrammarState(future.result())
            self.waiting.append(req)
        self.compiling = still
        return outputs

    def _max_tokens(self, request: GenerateRequest) -> int:
        """The request's max_tokens. Unset: --default-max-tokens, or less where the context
        or the pool ends first."""
        if request.params.max_tokens is not None:
            return request.params.max_tokens
        room = min(self.limits.context_length, self.kv.pool_tokens + 1) - len(request.input_ids)
        return max(1, min(self.limits.default_max_tokens, room))

    def _ending_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request: its stop tokens, and EOS unless it ignores EOS."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos

    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError, naming the problem, if `request` cannot run here. The
        checks run in this order, so a request with several problems is told the first."""
        self._check_ids(request)
        request.params.validate(self.limits.vocab_size)
        self._check_tokenizer_features(request.params)
        self.role.validate(request)
        check_prompt_tokens(self.limits.context_length, len(request.input_ids))
        max_tokens = self._max_tokens(request)
        self._check_min_tokens(request.params, max_tokens)
        self._check_context(len(request.input_ids), max_tokens)
        self._check_kv_pool(request, max_tokens)
        self._check_queue_space(request)

    def _check_ids(self, request: GenerateRequest) -> None:
        """A request id not in use, and a prompt of token ids in the vocabulary."""
        vocab_size = self.limits.vocab_size
        if request.rid in self.requests:
            raise InvalidRequestError(f"request id {request.rid!r} is already in use", param="rid")
        if len(request.input_ids) == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < vocab_size for t in request.input_ids):
            raise InvalidRequestError(
                f"the prompt has token ids outside the vocabulary (size {vocab_size})",
                param="prompt",
            )

    def _check_tokenizer_features(self, params: SamplingParams) -> None:
        """Stop strings and grammars need the model's tokenizer."""
        if params.stop and self.stop_checker is None:
            raise InvalidRequestError(
                "this model has no tokenizer: stop strings cannot be matched", param="stop"
            )
        if params.grammar is not None and self.grammars is None:
            raise InvalidRequestError(
                "this model has no tokenizer: its output cannot be constrained to a grammar",
                param=params.grammar.param,
            )

    def _check_min_tokens(self, params: SamplingParams, max_tokens: int) -> None:
        """min_tokens within the tokens the request may generate, and a token left to sample
        before it."""
        if params.min_tokens > max_tokens:  # max_tokens unset: the default, or less
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this "
                "request may generate here",
                param="min_tokens",
            )
        vocab_size = self.limits.vocab_size
        if params.min_tokens and self._ending_ids(params).issuperset(range(vocab_size)):
            # held back until min_tokens, every token would be: none is left to sample (the
            # check stops at the first id missing, at once for any other request)
            raise InvalidRequestError(
                f"with min_tokens ({params.min_tokens}), stop_token_ids"
                f"{'' if params.ignore_eos else ' and EOS'} may not cover the whole vocabulary "
                f"(size {vocab_size}): no token could be sampled before min_tokens",
                param="stop_token_ids",
            )

    def _check_context(self, n: int, max_tokens: int) -> None:
        """The prompt (`n` tokens) and max_tokens within the context length."""
        context_length = self.limits.context_length
        if n + max_tokens > context_length:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds this model's context "
                f"length of {context_length}; lower max_tokens to at most {context_length - n}",
                param="max_tokens",
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def _check_kv_pool(self, request: GenerateRequest, max_tokens: int) -> None:
        """The KV the request may fill here (its role's count) within the pool: the prompt's
        alone, then with max_tokens."""
        n, room = len(request.input_ids), request.bootstrap is not None
        page, total_pages, pool_tokens = (
            self.kv.page_size,
            self.kv.allocator.total_pages,
            self.kv.pool_tokens,
        )
        need = self.role.kv_tokens(n, max_tokens, room)
        if pages_for(need, page) <= total_pages:
            return
        prompt_need = self.role.kv_tokens(n, 1, room)
        if pages_for(prompt_need, page) > total_pages:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) needs {prompt_need} tokens of KV cache; the pool "
                f"holds {pool_tokens}",
                param="prompt",
            )
        raise InvalidRequestError(
            f"the request needs {need} tokens of KV cache; the pool holds {pool_tokens}: "
            f"lower max_tokens to at most {pool_tokens - prompt_need + 1}",
            param="max_tokens",
        )

    def _check_queue_space(self, request: GenerateRequest) -> None:
        """Room in the queue (--max-queued-requests). Checked last: a request that could never
        run is a 400; a health probe is never turned away for a busy engine; and a client
        request's later sequences follow its first, so that none is refused in part. Only
        while the first is here: one that already finished (its one token, a stop or an error
        before its followers arrived) leaves them to the queue's check, and a refused one
        fails the whole request in the API server, whose client gets the 503 and no partial
        answer."""
        queued, most = self._num_queued(), self.limits.max_queued_requests
        exempt = request.probe or request.request_leader in self.requests
        if most is not None and not exempt and queued >= most:
            raise InvalidRequestError(
                f"the request queue is full: {queued} requests wait for admission "
                f"(--max-queued-requests {most}); try again shortly or on another engine",
                status=503,
            )

    def abort_request(self, rid: str, message: str = "aborted") -> list[TokenOutput]:
        """End a request wherever it is. Returns its final output (none if unknown or done)."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return []
        req.finish_reason = FinishReason("abort", message=message)
        self._finish(req)
        out = self._output(req, [], None)
        self._release_completed()
        return [out]

    # -- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return (
            self.has_steps()
            or bool(self.finished_unreleased or self.compiling)
            or self.role.has_work()
        )

    def has_steps(self) -> bool:
        """Work for the model; without it, a turn only polls the role's KV transfers."""
        return bool(self.waiting or self.prefilling or self.decoding or self._in_flight)

    def step(self) -> list[TokenOutput]:
        """Apply what the role's KV transfers report, schedule and launch one step; with
        overlap, handle the previous step's results."""
        outputs: list[TokenOutput] = []
        batch = in_flight = None
        try:
            if self.compiling:
                outputs += self._queue_compiled()
            outputs += self._apply_role_events()
            batch = self._schedule()
            outputs += self._drained
            self._drained = []
            launched = (batch, self._launch(batch)) if batch else None
            if self.overlap:
                in_flight, self._in_flight = self._in_flight, launched
                try:
                    if in_flight is not None:
                        outputs += self._process_or_fail(*in_flight)
                finally:  # the executor waits for this mask: it must be set even if this failed
                    if batch is not None:
                        self._fill_vocab_mask(batch)
            elif launched is not None:
                outputs += self._process_or_fail(*launched)
        except BaseException:
            self._drained = outputs + self._drained  # not lost: the next turn hands them out
            raise
        released = self._release_completed()
        self._turn_ran_nothing = batch is None and in_flight is None and not (outputs or released)
        return outputs

    @property
    def waits_for_events(self) -> bool:
        """The last turn launched and finished no step, handed nothing out and freed nothing:
        what is queued waits for an event (a KV transfer, a message, a grammar compiled), which
        the process's loop waits for instead of turning again at once on a busy core."""
        return self._turn_ran_nothing

    def _launch(self, batch: ScheduledBatch) -> Future[PendingStep]:
        try:
            if not self.overlap:  # with overlap, filled while the step before is processed
                self._fill_vocab_mask(batch)
            return self.executor.launch(batch.forward)
        except BaseException as exc:
            # It never ran: its requests wait only for the step in flight, if there is one.
            running = self._in_flight[0].step if self._in_flight else self._completed_step
            for req in batch.reqs:
                req.last_step = min(req.last_step, running)
            self._fail_requests(batch, exc)
            raise

    def _process_or_fail(
        self, batch: ScheduledBatch, future: Future[PendingStep]
    ) -> list[TokenOutput]:
        try:
            return self._process(batch, future)
        except BaseException as exc:
            self._completed_step = max(self._completed_step, batch.step)  # it ran, and ended
            self._fail_requests(batch, exc)
            raise

    def _fail_requests(self, batch: ScheduledBatch, error: BaseException) -> None:
        """A step that failed (the device, or a bug) ends every request in it with an error,
        kept for the next turn's outputs, so that they are released once no step uses them
        and the engine can serve the next requests. Its caller raises the error on."""
        self.contained_failure = error
        message = f"the step failed: {type(error).__name__}: {error}"
        for req in batch.reqs:
            req.kv_lost = True
            if not req.finished:
                req.finish_reason = FinishReason("error", message=message, status=500)
                self._finish(req)
                self._drained.append(self._output(req, [], None))

    def _fill_vocab_mask(self, batch: ScheduledBatch) -> None:
        """Each grammar row's allowed tokens, from its matcher, which must have accepted every
        earlier token of its request (with overlap: after the step before was processed)."""
        mask: VocabMask | None = batch.forward.sampling.vocab_mask
        if mask is None:
            return
        try:
            for i, req in enumerate(batch.reqs):
                if req.grammar is None or not batch.emits[i] or req.finished:
                    continue  # all tokens allowed: a finished request's token is dropped anyway
                # this step samples token number outputs_scheduled; all before it are accepted
                assert len(req.output_ids) == req.outputs_scheduled - 1, (
                    req.rid,
                    len(req.output_ids),
                )
                req.grammar.fill_mask(mask.bitmask, i)
        except BaseException as exc:
            mask.set_ready(exc)
            raise
        mask.set_ready()

    def drain(self) -> list[TokenOutput]:
        """Finish the step in flight, if any (before shutdown or an integrity check)."""
        outputs = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            outputs = self._process_or_fail(*in_flight)
        self._release_completed()
        return outputs

    # -- scheduling --------------------------------------------------------------------
    def _schedule(self) -> ScheduledBatch | None:
        ready = self._fit_decode([r for r in self.decoding if r.outputs_scheduled < r.max_tokens])
        # The pages these decodes take next are theirs, whether they run in this step (mixed)
        # or the next: a request admitted now that took one would be retracted at once.
        self.kv.reserve_decode_pages(ready)
        mixing = self.limits.mixed_chunk and bool(ready)
        chunks = self._prefill_chunks(decode_tokens=len(ready) if mixing else 0)
        if chunks:
            return self.builder.mixed(chunks, ready) if mixing else self.builder.extend(chunks)
        return self.builder.decode(ready) if ready else None

    def _prefill_chunks(self, decode_tokens: int) -> list[tuple[Req, int]]:
        """The prompt chunks of the next step. With chunking, the step's `decode_tokens` (the
        decodes that ride along in a mixed step) come out of --chunked-prefill-size first."""
        limits = self.limits
        chunking = limits.chunked_prefill_size > 0
        budget = (
            limits.chunked_prefill_size - decode_tokens if chunking else limits.max_prefill_tokens
        )
        chunks: list[tuple[Req, int]] = []

        def take(req: Req) -> bool:
            nonlocal budget
            remaining = req.fill_len - req.num_scheduled
            n = min(remaining, budget) if chunking else remaining
            if n <= 0 or (not chunking and chunks and n > budget):
                return False
            chunks.append((req, n))
            budget -= n
            return True

        for req in self.prefilling:
            if req.num_scheduled < req.fill_len and not take(req):
                break
        deferred: list[Req] = []
        if budget > 0 and self._num_running() < limits.max_running_requests:
            self.policy.reorder(self.waiting)
        while self.waiting and budget > 0:
            if self._num_running() >= limits.max_running_requests:
                break
            req = self.waiting[0]
            if self._leader_prefilling(req) or not self.role.may_admit(req):
                # admitted once the leader's prompt is cached, or the role lets it in
                deferred.append(self.waiting.popleft())
                continue
            if not self.role.admit(req):
                break
            self.waiting.popleft()
            if req.status is not ReqStatus.WAITING:
                req.admitted = time.perf_counter()
                continue  # the role holds it (a decode engine's request awaiting its KV)
            req.status = ReqStatus.PREFILLING
            self.prefilling.append(req)
            if not req.retractions:
                req.admitted = time.perf_counter()
                self._prompt_tokens += req.prompt_len
                self._cached_prompt_tokens += req.num_prefix_hit
            if not take(req):
                break
        self.waiting.extendleft(reversed(deferred))
        return chunks

    # -- retraction ----------------------------------------------------------------------
    def _fit_decode(self, ready: list[Req]) -> list[Req]:
        """The requests of the next decode step, after retracting others until their KV fits.
        A request that cannot grow even then waits for pages (the KV transfers of a P/D
        engine's rooms, which never outgrow their reservations, end in time)."""
        if self.kv.pages_short(ready) == 0:
            return ready
        if self._in_flight is not None:  # retraction frees pages: no step may still use them
            in_flight, self._in_flight = self._in_flight, None
            self._drained += self._process_or_fail(*in_flight)
            self._release_completed()
            ready = [r for r in ready if not r.finished]
        retracted = 0
        while ready and self.kv.pages_short(ready) > 0:
            victims = [r for r in self.prefilling + self.decoding if r.bootstrap is None]
            if not victims or (len(ready) == 1 and victims == ready):
                ready = []  # retracting the one request that needs the pages would gain nothing
                break
            victim = min(victims, key=self._redo_cost)
            self._retract(victim)
            retracted += 1
            if victim in ready:
                ready.remove(victim)
        if retracted:
            # one shortage, one sign the estimate is short, however many requests it took:
            # backing off per request would compound a burst into whole reservations
            self.kv.estimate.retracted()
        return ready

    @staticmethod
    def _redo_cost(req: Req) -> tuple[int, int]:
        """Decode steps lost, then (for a tie) pages kept: re-admission prefills its tokens in
        one step, mostly from the radix cache, while its decode steps ran one at a time."""
        return len(req.output_ids), -len(req.slots)

    def _retract(self, req: Req) -> None:
        (self.prefilling if req.status is ReqStatus.PREFILLING else self.decoding).remove(req)
        self.kv.retract(req)
        req.requeue()
        self.waiting.appendleft(req)
        self._retractions += 1
        logger.debug(
            "retracted request %s after %d outputs (KV pool full)", req.rid, len(req.output_ids)
        )

    def _leader_prefilling(self, req: Req) -> bool:
        leader = self.requests.get(req.prefix_leader) if req.prefix_leader else None
        return leader is not None and leader.status in (ReqStatus.WAITING, ReqStatus.PREFILLING)

    def _num_queued(self) -> int:
        """Requests waiting for admission, those whose grammar compiles (seconds at times)
        included."""
        return len(self.waiting) + len(self.compiling)

    def _num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + self.role.num_held()

    # -- results -----------------------------------------------------------------------
    def _process(self, batch: ScheduledBatch, future: Future[PendingStep]) -> list[TokenOutput]:
        result = future.result().wait()
        self._completed_step = max(self._completed_step, batch.step)
        outputs = []
        for i, req in enumerate(batch.reqs):
            if not req.kv_lost:
                req.num_computed += batch.extend_lens[i]
            if req.finished:
                continue  # finished or aborted while this step ran: its token is dropped
            if i < batch.prefill_rows:
                self.kv.cache_prefix(req)
                if not batch.emits[i]:
                    continue  # a chunk before its prompt's last: no token, no logprobs sampled
            token, logprob = result.token_ids[i], self._logprob(result, i, req)
            if i < batch.prefill_rows:
                self.prefilling.remove(req)
                if self.role.prompt_done(req, token, logprob):
                    req.prompt_done_at = time.perf_counter()
                    continue  # the role keeps it (a prefill engine's request: its KV goes out)
                req.status = ReqStatus.DECODING
                self.decoding.append(req)
            outputs.append(self._accept(req, token, logprob))
        return outputs

    @staticmethod
    def _logprob(result: StepResult, i: int, req: Req) -> TokenLogprob | None:
        if result.logprobs is None or req.params.logprobs is None:
            return None
        k = req.params.logprobs
        top: list[tuple[int, float]] = []
        if k:  # the step sampled the top ids of its batch's largest k
            assert result.top_ids is not None and result.top_logprobs is not None
            top = list(zip(result.top_ids[i][:k], result.top_logprobs[i][:k]))
        return TokenLogprob(result.token_ids[i], result.logprobs[i], top)

    def _accept(self, req: Req, token: int, logprob: TokenLogprob | None) -> TokenOutput:
        """A new output token of a decoding request: kept, checked for the end, sent."""
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        try:
            reason = self._finish_reason(req, token)
        except Exception as exc:  # stop-string matching of one request must not stop the others
            logger.exception("checking request %s for its end failed", req.rid)
            reason = FinishReason(
                "error",
                message=f"internal error checking for stop strings: {type(exc).__name__}: {exc}",
                status=500,
            )
        if reason is not None:
            req.finish_reason = reason
            self._finish(req)
        return self._output(req, [token], [logprob] if logprob else None)

    def _apply_role_events(self) -> list[TokenOutput]:
        outputs = []
        for event in self.role.poll():
            req = event.req
            if isinstance(event, KVArrived):  # it decodes from here as if it had prefilled here
                req.num_scheduled = req.num_computed = req.prompt_len
                req.num_prefix_hit = event.cached_tokens
                req.outputs_scheduled = 1
                req.status = ReqStatus.DECODING
                self.decoding.append(req)
                outputs.append(self._accept(req, event.token, event.logprob))
            elif isinstance(event, KVSent):  # its answer is the first token
                req.finish_reason = FinishReason("length")
                self._finish(req)
                outputs.append(self._output(req, list(req.output_ids), list(req.logprobs) or None))
            else:
                req.finish_reason = event.reason
                self._finish(req)
                outputs.append(self._output(req, [], None))
        return outputs

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        params = req.params
        # EOS first, as vLLM does: an EOS id also in stop_token_ids names no stop_reason
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason("stop", matched_token=token)
        if token in req.stop_ids:
            return FinishReason("stop", matched_token=token, stop_token=True)
        if req.grammar is not None:
            if not req.grammar.accept(token):
                return FinishReason(
                    "error", message=f"token {token} breaks the request's grammar", status=500
                )
            if req.grammar.terminated:  # the grammar's end: its stop token, not part of the text
                return FinishReason("stop", matched_token=token)
        if params.stop:
            assert self.stop_checker is not None  # validate() refuses stop strings without one
            if (matched := self.stop_checker.match(req)) is not None:
                stop, end = matched
                return FinishReason("stop", matched_str=stop, matched_end=end)
        if len(req.output_ids) >= req.max_tokens:
            return FinishReason("length")
        return None

    def _finish(self, req: Req) -> None:
        if (
            req.bootstrap is None
            and req.finish_reason is not None
            and req.finish_reason.kind in ("stop", "length")
        ):
            # the estimate learns only from requests that ran to their own end
            self.kv.estimate.finished(len(req.output_ids), req.max_tokens)
        if req.status is ReqStatus.WAITING:  # not admitted yet (or retracted): still queued
            if req in self.compiling:
                self.compiling.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.decoding:
            self.decoding.remove(req)
        self.role.finished(req)
        req.status = ReqStatus.FINISHED
        self.finished_unreleased.append(req)

    def _release_completed(self) -> bool:
        """Release finished requests that no step still running uses; whether any was."""
        keep = []
        for req in self.finished_unreleased:
            if req.last_step > self._completed_step or not self.role.can_release(req):
                keep.append(req)
                continue
            self.kv.release(req)
            self.requests.pop(req.rid, None)
        released = len(keep) < len(self.finished_unreleased)
        self.finished_unreleased = keep
        return released

    def _output(
        self, req: Req, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> TokenOutput:
        out = TokenOutput(
            rid=req.rid,
            token_ids=tokens,
            finish_reason=req.finish_reason,
            logprobs=logprobs,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.num_prefix_hit,
            completion_tokens=len(req.output_ids),
        )
        if tokens and req.admitted is not None and not req.timings_sent:
            req.timings_sent = True
            now = time.perf_counter()
            first_token = now if req.prompt_done_at is None else req.prompt_done_at
            out.queue_seconds, out.prefill_seconds = (
                max(0.0, req.admitted - req.arrived - req.slots_wait),
                first_token - req.admitted,
            )
            if req.prompt_done_at is not None:  # handed off: its answer waited for the KV
                out.handoff_seconds = now - req.prompt_done_at + req.slots_wait
        return out

    def reset(self) -> None:
        """Empty the prefix cache and zero the counters (only while idle)."""
        assert not self.has_work(), "reset while requests are running"
        self.kv.flush_cache()
        self._prompt_tokens = self._cached_prompt_tokens = 0

    # -- inspection --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise if the KV bookkeeping breaks its invariants (every page in exactly one place);
        an invariant check that tests call after their requests, never the serving loop."""
        self.kv.check_integrity(self.requests.values())

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self._num_running(),
            num_waiting=self._num_queued(),
            kv_used_tokens=self.kv.committed_tokens(),
            kv_total_tokens=self.kv.pool_tokens,
            prompt_tokens=self._prompt_tokens,
            cached_prompt_tokens=self._cached_prompt_tokens,
            disagg=self.role.stats(),
            retractions=self._retractions,
            grammar=self.grammars.take_stats() if self.grammars is not None else None,
        )
