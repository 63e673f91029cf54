"""Picks workers for a request and retries elsewhere while nothing has reached the client."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from kubesgl.router.errors import RouterError, no_worker
from kubesgl.router.health import MODELS_PATH
from kubesgl.router.kv_layouts import LayoutPairing
from kubesgl.router.metrics import CONNECTION_LIMIT, PDRoute, RouterMetrics
from kubesgl.router.model_list import cards_of, merged, served_sets
from kubesgl.router.options import check_bounds, option
from kubesgl.router.pd import PrefillDecodePair
from kubesgl.router.policies import Choice, Policy
from kubesgl.router.prefill_outage import PrefillOutages
from kubesgl.router.request_parsing import ParsedRequest
from kubesgl.router.upstream import Headers, Reply, UpstreamClient, UpstreamError
from kubesgl.router.workers import Role, Worker, WorkerRegistry

log = logging.getLogger("kubesgl.router")
_RETRY_ERROR = "retry counts and backoffs must not be negative"
_DISAGGREGATION_ERROR = (
    "P/D: the shortest prefill to hand over is >= 0 tokens, the in-flight limit >= 1"
)


@dataclass(frozen=True, kw_only=True)  # keywords only: two floats swapped would type-check
class RetrySettings:
    max_retries: int = option(
        3,
        flag="--max-retries",
        help="times a request a worker failed before answering is sent again, to another worker "
        "where there is one",
        error=_RETRY_ERROR,
        ge=0,
    )
    initial_backoff_s: float = option(
        0.05,
        flag="--retry-initial-backoff",
        help="seconds before the first retry; each next one waits twice as long",
        error=_RETRY_ERROR,
        ge=0,
    )
    max_backoff_s: float = option(
        1.0,
        flag="--retry-max-backoff",
        help="longest wait before a retry",
        error=_RETRY_ERROR,
        ge=0,
    )
    multiplier: float = 2.0
    jitter: float = 0.2  # +-20%: retries of many requests do not land in lockstep

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("the backoff multiplier must be >= 1 and the jitter in [0, 1)")

    def backoff_s(self, retry: int) -> float:
        delay = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry)
        return delay * random.uniform(1 - self.jitter, 1 + self.jitter)


@dataclass(frozen=True, kw_only=True)  # keywords only: two floats swapped would type-check
class DisaggregationSettings:
    """When the router sends a request to a decode worker alone, which prefills it itself."""

    # An uncached prompt shorter than this costs less to prefill in place than to hand over:
    # 128 tokens of the 8B shape prefill in ~3.4 ms on an H200 (37k tokens/s, benchmarks/README.md),
    # less than one decode step, while a handoff adds a second request and a KV write (~2-3 ms).
    min_prefill_tokens: int = option(
        128,
        flag="--pd-min-prefill-tokens",
        help="requests whose uncached prompt is shorter (estimated at 4 characters a token for "
        "text) go to a decode worker alone; 0: always disaggregate",
        error=_DISAGGREGATION_ERROR,
        ge=0,
    )
    # Every prefill worker has this many requests in flight: the prefill pool is saturated.
    max_prefill_in_flight: int = option(
        64,
        flag="--pd-max-prefill-in-flight",
        help="when every prefill worker has this many requests in flight, new ones go to a "
        "decode worker alone",
        error=_DISAGGREGATION_ERROR,
        ge=1,
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class Policies:
    mixed: Policy
    prefill: Policy
    decode: Policy

    def all(self) -> tuple[Policy, Policy, Policy]:
        return (self.mixed, self.prefill, self.decode)


class Forwarder:
    def __init__(
        self,
        workers: WorkerRegistry,
        policies: Policies,
        upstream: UpstreamClient,
        metrics: RouterMetrics,
        retry: RetrySettings,
        disaggregation: DisaggregationSettings,
        retry_after_s: int = 1,
    ) -> None:
        self.workers = workers
        # A client told "no worker can serve" should ask again no sooner than the pool may
        # change (a worker's next health check, or its breaker's trial)
        self.retry_after_s = retry_after_s
        self.policies = policies
        self.upstream = upstream
        self.metrics = metrics
        self.retry = retry
        self.disaggregation = disaggregation
        self.pd = PrefillDecodePair(upstream)
        self._prefill_outages = PrefillOutages(
            lambda model: any(w.serves(model) for w in workers.with_role(Role.DECODE))
        )
        self._kv_layouts = LayoutPairing(
            lambda: {w.kv_layout for w in workers.with_role(Role.DECODE)}
        )
        # The sets of served names the last GET /v1/models left out (their workers failed)
        self._unlisted: set[frozenset[str]] = set()
        for policy in policies.all():
            workers.on_removed(policy.forget)
            workers.on_restarted(policy.forget)  # its KV cache is empty

    async def aclose(self) -> None:
        """Ends the work it left running after its answers (before the session closes)."""
        await self.pd.aclose()

    async def generate(self, request: ParsedRequest, headers: Headers) -> Reply:
        if self.workers.is_disaggregated():
            return await self._with_retries(
                lambda excluded, retry_once_left: self._pd_once(
                    request, headers, excluded, retry_once_left
                )
            )
        return await self._with_retries(
            lambda excluded, _: self._mixed_once(request, headers, excluded)
        )

    async def any_worker(
        self, method: str, path: str, body: bytes | None, headers: Headers, model: str | None
    ) -> Reply:
        """A request every worker of `model` (None: any worker) answers alike, from the least
        loaded one that answers it (a decode worker in P/D mode): the model (a card, SGLang's
        /model_info), its tokenizer (vLLM's /tokenize, /detokenize), the version."""
        pool = partial(self._candidates, self._answering_role(), model=model)
        return await self._least_loaded(pool, method, path, body, headers)

    async def list_models(self, headers: Headers) -> Reply:
        """GET /v1/models: the models the available workers serve (decode workers in P/D mode).
        One worker of each set of served names answers, the least loaded, as any_worker; their
        cards are merged by id. A set whose workers fail (after retries) is left out, and
        logged: while one model's workers are down or loading, the others' stay listed. Only
        if no set answers does the client get an error, the first set's."""
        role = self._answering_role()
        sets = served_sets(self.workers.available(role))
        if len(sets) < 2:  # one set of names (or none: the 503): that worker's answer as it is
            return await self.any_worker("GET", MODELS_PATH, None, headers, None)
        # the router reads the answers: no compressed ones
        headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"]
        outcomes = await asyncio.gather(*(self._models_of(role, s, headers) for s in sets))
        card_lists = [cards_of(outcome) for outcome in outcomes]
        if all(cards is None for cards in card_lists):
            return self._first_outcome(role, outcomes[0])
        unlisted = {names for names, cards in zip(sets, card_lists) if cards is None}
        for names, outcome, cards in zip(sets, outcomes, card_lists):
            if cards is None:
                # a warning when a set starts failing, not at each listing (UIs poll it)
                level = logging.DEBUG if names in self._unlisted else logging.WARNING
                reason = outcome if isinstance(outcome, Exception) else "no model list"
                log.log(
                    level,
                    "GET %s: the workers serving %s gave no model list (%s); the list "
                    "leaves their models out",
                    MODELS_PATH,
                    _named(names),
                    reason,
                )
        self._unlisted = unlisted
        return merged(cards for cards in card_lists if cards is not None)

    async def _models_of(
        self, role: Role, names: frozenset[str], headers: Headers
    ) -> Reply | RouterError | UpstreamError:
        """The /v1/models answer of a worker serving `names`, or why there is none."""
        pool = partial(self._serving, role, names)
        try:
            return await self._least_loaded(pool, "GET", MODELS_PATH, None, headers)
        except (RouterError, UpstreamError) as error:
            return error

    def _first_outcome(self, role: Role, outcome: Reply | RouterError | UpstreamError) -> Reply:
        """A list no set answered is the first set's answer or error, as one worker's list."""
        if isinstance(outcome, RouterError) and outcome.reason == CONNECTION_LIMIT:
            raise outcome  # no free connection (--max-connections), not a worker missing
        if isinstance(outcome, RouterError):  # its workers left the pool: _candidates's 503
            raise self.no_worker_error(role)
        if isinstance(outcome, UpstreamError):
            raise outcome
        return outcome

    def _answering_role(self) -> Role:
        return Role.DECODE if self.workers.is_disaggregated() else Role.MIXED

    async def _least_loaded(
        self,
        pool: Callable[[set[Worker]], list[Worker]],
        method: str,
        path: str,
        body: bytes | None,
        headers: Headers,
    ) -> Reply:
        """The answer of the least loaded of `pool(excluded)`, retried as a generation request."""

        async def once(excluded: set[Worker], _: bool) -> Reply:
            worker = min(pool(excluded), key=lambda w: w.in_flight)
            return await self.upstream.exchange(worker, method, path, body, headers, stream=False)

        return await self._with_retries(once)

    async def _with_retries(self, once: Callable[[set[Worker], bool], Awaitable[Reply]]) -> Reply:
        """`once(excluded, retry_once_left)`'s answer, tried again as its errors allow:
        `retry_once_left` tells an attempt whether a `retry_once` error of its own would be
        retried (else that error is the client's answer)."""
        excluded: set[Worker] = set()
        retry = 0
        broke_one = False  # a retry_once failure was retried already: the next is the answer
        while True:
            retry_once_left = not broke_one and retry < self.retry.max_retries
            try:
                return await once(excluded, retry_once_left)
            except UpstreamError as error:
                may_retry = error.retryable or (error.retry_once and retry_once_left)
                if not may_retry or retry >= self.retry.max_retries:
                    raise
                broke_one = broke_one or error.retry_once
                excluded.add(error.worker)
                self.metrics.retries.inc()
                log.info("retry %d of %d: %s", retry + 1, self.retry.max_retries, error)
                await asyncio.sleep(self.retry.backoff_s(retry))
                retry += 1

    def _candidates(self, role: Role, excluded: set[Worker], model: str | None) -> list[Worker]:
        available = self.workers.available(role, model)
        if not available:
            self._check_served(role, model)
            raise self.no_worker_error(role, model)
        return _without_failed_unless_none_left(available, excluded)

    def _serving(self, role: Role, names: frozenset[str], excluded: set[Worker]) -> list[Worker]:
        """The available workers that serve exactly `names` (a set of served_sets)."""
        available = [w for w in self.workers.available(role) if frozenset(w.models) == names]
        if not available:  # they left the pool since the list was asked
            raise no_worker(f"no {role.value} worker serving {_named(names)} is left")
        return _without_failed_unless_none_left(available, excluded)

    def _check_served(self, role: Role, model: str | None) -> None:
        """A 404 for a model no registered worker serves, as an engine answers one it does not
        serve: while workers of two served names share the router (a rename rolling out), a
        request goes only to those of its model, and one for neither must not wait for one."""
        registered = self.workers.with_role(role)
        if model is None or not registered or any(w.serves(model) for w in registered):
            return
        served = ", ".join(sorted({repr(m) for w in registered for m in w.models}))
        raise RouterError(
            404,
            f"the model {model!r} does not exist; the workers serve {served}",
            param="model",
            code="model_not_found",
        )

    def no_worker_error(self, role: Role, model: str | None = None) -> RouterError:
        registered = [w for w in self.workers.with_role(role) if w.serves(model)]
        label = "" if role is Role.MIXED else f"{role.value} "
        if not registered:
            error = no_worker(f"no {label}worker is registered")
        else:
            out = [w for w in registered if not w.healthy]
            unchecked = sum(w.unchecked for w in out)
            returning = sum(w.returning for w in out)
            new = f"{unchecked} not health-checked yet, " if unchecked else ""
            back = f"{returning} passing health checks, not back yet, " if returning else ""
            error = no_worker(
                f"no {label}worker can serve: {len(registered)} registered, "
                f"{len(out) - unchecked - returning} failing health checks, {new}{back}"
                f"{len(registered) - len(out)} with an open circuit breaker"
            )
        error.headers.append((b"retry-after", str(self.retry_after_s).encode()))
        return error

    def _choose(self, policy: Policy, candidates: list[Worker], request: ParsedRequest) -> Choice:
        """The policy's pick among `candidates` (from _candidates), its cache decision counted."""
        choice: Choice = policy.choose(candidates, request.routing_text)
        if choice.decision is not None:
            self.metrics.cache_decisions.labels(choice.decision).inc()
        return choice

    async def _mixed_once(
        self, request: ParsedRequest, headers: Headers, excluded: set[Worker]
    ) -> Reply:
        candidates = self._candidates(Role.MIXED, excluded, request.model)
        worker = self._choose(self.policies.mixed, candidates, request).worker
        return await self.upstream.exchange(
            worker, "POST", request.path, request.raw, headers, stream=request.stream
        )

    async def _pd_once(
        self, request: ParsedRequest, headers: Headers, excluded: set[Worker], retry_once_left: bool
    ) -> Reply:
        decodes = self._candidates(Role.DECODE, excluded, request.model)
        # The prefill pool, asked once and before choosing, so that a policy never records a
        # request never sent (the decode worker gets every request, alone or not); the
        # prefill policy chooses among it when the request is handed over.
        prefills = self._prefill_pool(excluded, request.model)
        decode = self._choose(self.policies.decode, decodes, request)
        # those of them the decode worker's pool can take the KV of (router/kv_layouts.py)
        paired = self._kv_layouts.prefills_for(decode.worker, prefills, request.model, not excluded)
        route = self._pd_route(request, prefills, decode, paired)
        routed = True
        try:
            # a decode engine prefills a request without a room itself
            if route != PDRoute.DISAGGREGATED:
                return await self.upstream.exchange(
                    decode.worker, "POST", request.path, request.raw, headers, stream=request.stream
                )
            prefill = self._choose(self.policies.prefill, paired, request).worker
            return await self.pd.exchange(request, prefill, decode.worker, headers)
        except UpstreamError as error:
            # Served no route: refused before any work, or cut short by a prefill engine that
            # died under it and retried (the retry counts its own; one not retried, the one
            # retry spent or none allowed, is the client's answer and counts this route), or
            # refused as a request the engines do not take (a 404 for a model they do not
            # serve, a 400)
            routed = not (
                error.before_work
                or (error.retry_once and retry_once_left)
                or (error.answered and error.status < 500)
            )
            raise
        except RouterError:  # the router's own refusal (no free connection): sent nowhere
            routed = False
            raise
        finally:
            if routed:
                self.metrics.pd_routes.labels(route).inc()

    def _prefill_pool(self, excluded: set[Worker], model: str | None) -> list[Worker]:
        """The prefill workers that may take the request, maybe none: a decode worker then
        prefills it itself rather than the router refusing it (or retrying it on a prefill
        worker that failed it already) while the decode pool can serve."""
        available = self.workers.available(Role.PREFILL, model)
        why_missing = (
            None if available else lambda: self.no_worker_error(Role.PREFILL, model).message
        )
        self._prefill_outages.note(model, why_missing)
        return [w for w in available if w not in excluded]

    def _pd_route(
        self,
        request: ParsedRequest,
        prefills: list[Worker],
        decode: Choice,
        paired: list[Worker],
    ) -> PDRoute:
        """`paired`: those of `prefills` the decode worker pairs with (kv_layouts.py)."""
        settings = self.disaggregation
        # Sent alone, the decode worker prefills what it lacks: the prompt less the prefix the
        # decode policy believes it holds (the prefill pool's cache would not help it); for a
        # batch every prompt, the first's cached prefix only taken off (the policy matched it
        # alone), whatever `n` (the copies of a prompt share its prefill).
        uncached = request.prompt_chars - decode.cached
        if request.tokens(uncached) < settings.min_prefill_tokens:
            return PDRoute.DECODE_ONLY_SHORT
        if not prefills:
            return PDRoute.DECODE_ONLY_NO_PREFILL
        if not paired:
            return PDRoute.DECODE_ONLY_INCOMPATIBLE
        if all(w.in_flight >= settings.max_prefill_in_flight for w in paired):
            return PDRoute.DECODE_ONLY_SATURATED
        return PDRoute.DISAGGREGATED


def _named(names: frozenset[str]) -> str:
    return ", ".join(sorted(map(repr, names))) or "models not named yet"


def _without_failed_unless_none_left(
    available: list[Worker], excluded: set[Worker]
) -> list[Worker]:
    # Workers that just failed this request are left out, unless they are all there is.
    return [w for w in available if w not in excluded] or available
