"""The order in which admission takes waiting requests (--schedule-policy).

- fcfs: arrival order (a retracted request goes back to the front).
- lpm: longest prefix already in the radix cache first, so that a cached prefix is reused
  before it is evicted; ties keep arrival order.
- dfs-weight: requests grouped by the cached prefixes they share, walking the radix tree
  depth first and taking the branch with the most waiting requests first, so that requests
  sharing a prefix are admitted together; requests with no cached prefix come last.

A request that has waited longer than --schedule-max-wait seconds goes before every other
request the policy would put first (overdue requests among themselves in arrival order):
no request waits for ever behind a stream of better-matching ones. The prefix policies order
the first `MAX_ORDERED` waiting requests and leave the rest behind them as they are, since
matching every request of a long queue against the tree each step would cost more than it
saves (SGLang falls back to arrival order instead, which leaves an offline batch of a few
hundred requests in arrival order from start to end).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import get_args

from kubesgl.engine.config import SchedulePolicyName
from kubesgl.engine.kvcache.radix_cache import RadixCache, TreeNode
from kubesgl.engine.scheduler.request import Req

MAX_ORDERED = 128  # waiting requests ordered per step, from the head of the queue

Ordering = Callable[[list[Req], RadixCache], list[Req]]


def first_come_first_served(waiting: list[Req], cache: RadixCache) -> list[Req]:
    return waiting


def longest_prefix_match(waiting: list[Req], cache: RadixCache) -> list[Req]:
    matched = {id(req): cache.peek_prefix(req.fill_ids()[:-1])[0] for req in waiting}
    return sorted(waiting, key=lambda req: -matched[id(req)])


def dfs_weight(waiting: list[Req], cache: RadixCache) -> list[Req]:
    at_node: dict[TreeNode, list[Req]] = defaultdict(list)
    weight: Counter[TreeNode] = Counter()
    for req in waiting:
        leaf = cache.peek_prefix(req.fill_ids()[:-1])[1]
        at_node[leaf].append(req)
        node: TreeNode | None = leaf
        while node is not None:
            weight[node] += 1
            node = node.parent
    # Post-order: a node's branches (heaviest first) before the requests that end at the node,
    # so the requests matching least come last.
    ordered: list[Req] = []
    stack: list[tuple[TreeNode, bool]] = [(cache.root, False)]
    while stack:
        node, walked = stack.pop()
        if walked:
            ordered += at_node.get(node, [])
            continue
        stack.append((node, True))
        # pushed lightest first: the heaviest branch is walked next
        stack += [
            (c, False)
            for c in sorted(
                (c for c in node.children.values() if weight[c]), key=lambda c: weight[c]
            )
        ]
    return ordered


SCHEDULE_POLICIES: dict[str, Ordering] = {
    "fcfs": first_come_first_served,
    "lpm": longest_prefix_match,
    "dfs-weight": dfs_weight,
}
# --schedule-policy's choices come from SchedulePolicyName: one policy for each of them
assert set(SCHEDULE_POLICIES) == set(get_args(SchedulePolicyName))


class SchedulePolicy:
    def __init__(
        self,
        name: str,
        cache: RadixCache,
        max_wait: float,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if name not in SCHEDULE_POLICIES:
            raise ValueError(
                f"unknown schedule policy {name!r}: one of {', '.join(SCHEDULE_POLICIES)}"
            )
        self._order = SCHEDULE_POLICIES[name]
        self.cache = cache
        self.max_wait = max_wait
        self.clock = clock

    def reorder(self, waiting: deque[Req]) -> None:
        """Put `waiting` in the order admission should take it."""
        if self._order is first_come_first_served:
            return
        head = [waiting.popleft() for _ in range(min(len(waiting), MAX_ORDERED))]
        deadline = self.clock() - self.max_wait
        # oldest first: the head keeps the order of earlier steps, not arrival order
        overdue = sorted((req for req in head if req.arrived <= deadline), key=lambda r: r.arrived)
        rest = [req for req in head if req.arrived > deadline]
        waiting.extendleft(reversed(overdue + self._order(rest, self.cache)))
