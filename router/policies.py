"""Routing policies: which of the workers that can serve gets a request."""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kubesgl.router.options import check_bounds, option
from kubesgl.router.radix_tree import PrefixTree
from kubesgl.router.workers import Worker

# The policies' names, for the operator's spec.router.policy; POLICIES below makes each
PolicyName = Literal["cache_aware", "round_robin", "power_of_two", "random"]


@dataclass(frozen=True)
class Choice:
    worker: Worker
    decision: str | None = None  # cache_aware only: hit | miss | balance
    cached: int = 0  # cache_aware only: characters of the text the worker held already


class Policy(ABC):
    @abstractmethod
    def choose(self, workers: Sequence[Worker], text: str) -> Choice:
        """Picks one of `workers` (never empty) for a request whose routing text is `text`."""

    def forget(self, worker: Worker) -> None:  # noqa: B027 - stateless policies keep nothing
        """Drops what the policy remembers about a worker that left the pool."""


class RoundRobinPolicy(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: Sequence[Worker], text: str) -> Choice:
        return Choice(workers[next(self._counter) % len(workers)])


class RandomPolicy(Policy):
    def choose(self, workers: Sequence[Worker], text: str) -> Choice:
        return Choice(random.choice(workers))


class PowerOfTwoPolicy(Policy):
    """Samples two workers and takes the one with fewer requests in flight."""

    def choose(self, workers: Sequence[Worker], text: str) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0])
        first, second = random.sample(workers, 2)
        return Choice(first if first.in_flight <= second.in_flight else second)


_BALANCE_ERROR = "balance thresholds: absolute >= 0, relative >= 1"


@dataclass(frozen=True, kw_only=True)  # keywords only: two floats swapped would type-check
class CacheAwareSettings:
    # Route to the longest match only when it covers more than this share of the request.
    cache_threshold: float = option(
        0.3,
        flag="--cache-threshold",
        help="cache_aware: least matched share of a request to follow its cache",
        error="cache threshold must be between 0 and 1",
        ge=0,
        le=1,
    )
    # Loads are imbalanced when max - min > abs threshold AND max > min * rel threshold. SGLang's
    # router takes 64, which a pool of a few engines at modest concurrency never reaches: every
    # request behind a cached prefix then goes to one engine, also after another one (re)joins
    # (48 of 48 in benchmarks/router/small_pool.py). 4 spreads such a pool for a few more prefills
    # (docs/router.md, Routing policies); large pools at high load are balanced by the ratio anyway.
    balance_abs_threshold: int = option(
        4,
        flag="--balance-abs-threshold",
        help="cache_aware: in-flight gap (max - min) beyond which loads are balanced",
        error=_BALANCE_ERROR,
        ge=0,
    )
    balance_rel_threshold: float = option(
        1.5,
        flag="--balance-rel-threshold",
        help="cache_aware: in-flight ratio (max / min) beyond which loads are balanced",
        error=_BALANCE_ERROR,
        ge=1,
    )
    max_tree_chars: int = option(
        2**24,
        flag="--max-tree-chars",
        help="cache_aware: characters remembered per worker (LRU eviction beyond)",
        error="the tree size bound must be positive",
        gt=0,
    )

    def __post_init__(self) -> None:
        check_bounds(self)


class CacheAwarePolicy(Policy):
    """Sends a request where its prefix most likely sits in the KV cache, unless loads diverge.

    1. Imbalanced loads (in-flight counts past both thresholds): the least loaded worker.
    2. Otherwise the worker whose tree shares the longest prefix with the request, if that
       prefix is more than `cache_threshold` of the request ("hit").
    3. Otherwise the worker whose tree holds the least text ("miss"): new prefixes spread out.
    The request's text then goes into the chosen worker's tree.
    """

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self._trees: dict[str, PrefixTree] = {}

    def tree(self, worker: Worker) -> PrefixTree:
        tree = self._trees.get(worker.url)
        if tree is None:
            tree = self._trees[worker.url] = PrefixTree(self.settings.max_tree_chars)
        return tree

    def forget(self, worker: Worker) -> None:
        self._trees.pop(worker.url, None)

    def _imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in workers]
        low, high = min(loads), max(loads)
        s = self.settings
        return high - low > s.balance_abs_threshold and high > low * s.balance_rel_threshold

    def choose(self, workers: Sequence[Worker], text: str) -> Choice:
        if self._imbalanced(workers):
            worker = min(workers, key=lambda w: w.in_flight)
            decision = "balance"
        else:
            matches = [(self.tree(w).match_length(text), -w.in_flight, w) for w in workers]
            best_length, _, best = max(matches, key=lambda m: m[:2])
            if text and best_length / len(text) > self.settings.cache_threshold:
                worker, decision = best, "hit"
            else:
                worker = min(workers, key=lambda w: (self.tree(w).size, w.in_flight))
                decision = "miss"
        cached = self.tree(worker).match_length(text)
        self.tree(worker).insert(text)
        return Choice(worker, decision, cached)


# name -> the policy it makes, given the cache_aware settings (the others take none); its names
# are PolicyName's (tests/unit/router/test_router_policies.py)
POLICIES: dict[str, Callable[[CacheAwareSettings | None], Policy]] = {
    "cache_aware": CacheAwarePolicy,
    "round_robin": lambda _: RoundRobinPolicy(),
    "power_of_two": lambda _: PowerOfTwoPolicy(),
    "random": lambda _: RandomPolicy(),
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, cache_settings: CacheAwareSettings | None = None) -> Policy:
    make = POLICIES.get(name)
    if make is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return make(cache_settings)
