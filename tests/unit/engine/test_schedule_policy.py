"""--schedule-policy: the order of the waiting queue, and its bound on any request's wait."""

from __future__ import annotations

from collections import deque

import pytest

from kubesgl.engine import SamplingParams
from kubesgl.engine.kvcache.allocator import PageAllocator
from kubesgl.engine.kvcache.radix_cache import NoPrefixCache, RadixCache
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.scheduler.request import Req
from kubesgl.engine.scheduler.schedule_policy import MAX_ORDERED, SchedulePolicy


def cache_with(*prefixes: list[int], page_size: int = 1) -> RadixCache:
    allocator = PageAllocator(256, page_size)
    cache = RadixCache(allocator)
    for tokens in prefixes:
        pages = allocator.alloc(len(tokens) // page_size)
        cache.insert(tokens, allocator.slots_of(pages))
    return cache


def req(rid: str, prompt: list[int], arrived: float = 0.0) -> Req:
    return Req(rid=rid, prompt_ids=prompt, params=SamplingParams(), arrived=arrived)


def order(name: str, cache, reqs: list[Req], now: float = 1.0, max_wait: float = 10.0) -> list[str]:
    queue = deque(reqs)
    SchedulePolicy(name, cache, max_wait, clock=lambda: now).reorder(queue)
    return [r.rid for r in queue]


A, B = list(range(10, 30)), list(range(100, 140))  # two cached prefixes, B the longer


def test_fcfs_keeps_arrival_order():
    reqs = [req("none", [7, 7, 7]), req("a", A + [1]), req("b", B + [1])]
    assert order("fcfs", cache_with(A, B), reqs) == ["none", "a", "b"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_lpm_takes_the_longest_cached_prefix_first(page_size):
    reqs = [req("none", [7, 7, 7]), req("a", A + [1]), req("b", B + [1]), req("a2", A + [2])]
    assert order("lpm", cache_with(A, B, page_size=page_size), reqs) == ["b", "a", "a2", "none"]


def test_dfs_weight_groups_requests_by_shared_prefix_largest_group_first():
    reqs = [
        req("b1", B + [1]),
        req("a1", A + [1]),
        req("none", [7, 7, 7]),
        req("a2", A + [2]),
        req("a3", A + [3]),
    ]
    assert order("dfs-weight", cache_with(A, B), reqs) == ["a1", "a2", "a3", "b1", "none"]


def test_peeking_changes_nothing_in_the_tree():
    cache = cache_with(A)
    before = [(id(n), n.last_access, len(n.key)) for n in cache._nodes()]
    order("lpm", cache, [req("half", A[:10] + [1]), req("a", A + [1])])
    assert [(id(n), n.last_access, len(n.key)) for n in cache._nodes()] == before


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_an_overdue_request_goes_first(name):
    reqs = [
        req("b", B + [1], arrived=0.5),
        req("old", [7, 7, 7], arrived=0.0),
        req("a", A + [1], arrived=0.6),
    ]
    assert order(name, cache_with(A, B), reqs, now=1.0, max_wait=10.0)[-1] == "old"
    assert order(name, cache_with(A, B), reqs, now=10.2, max_wait=10.0)[0] == "old"


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_overdue_requests_go_first_in_arrival_order(name):
    """Requests that became overdue in a queue the policy had already ordered (the later
    arrival, matching more, ahead) are taken oldest first, not in the order they were left in."""
    queue = deque([req("old", [7, 7, 7], arrived=0.0), req("newer", B + [1], arrived=2.0)])
    now = 5.0
    policy = SchedulePolicy(name, cache_with(A, B), max_wait=10.0, clock=lambda: now)
    policy.reorder(queue)
    assert [r.rid for r in queue] == ["newer", "old"]  # neither overdue: the longer match first
    now = 20.0
    policy.reorder(queue)
    assert [r.rid for r in queue] == ["old", "newer"]


def test_without_a_prefix_cache_prefix_policies_keep_arrival_order():
    cache = NoPrefixCache(PageAllocator(16, 1))
    reqs = [req("x", [5, 6, 7]), req("y", [1, 2, 3])]
    assert order("lpm", cache, reqs) == order("dfs-weight", cache, reqs) == ["x", "y"]


@pytest.mark.parametrize(
    "max_wait, admitted", [(0.05, True), (1e6, False)], ids=["bounded", "unbounded"]
)
def test_a_request_with_no_cached_prefix_is_not_starved(
    max_wait, admitted, tiny_model, make_llm, random_prompts
):
    """With lpm and one request at a time, a steady stream of requests that hit the cache
    always matches better than a lone unrelated request: only the wait bound admits it.
    (The unbounded case shows the stream would starve it.)"""
    llm = make_llm(
        tiny_model("llama"),
        schedule_policy="lpm",
        schedule_max_wait=max_wait,
        max_running_requests=1,
    )
    engine = llm.engine
    shared, lone = random_prompts(2, 40, 40, seed=31)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([shared], greedy)  # the stream's prefix is in the cache
    engine.add_request(GenerateRequest(rid="lone", input_ids=lone, params=greedy))
    done = False
    for i in range(200):
        engine.add_request(
            GenerateRequest(rid=f"s{i}", input_ids=shared + [3 + i % 500], params=greedy)
        )
        done = done or any(out.rid == "lone" for out in engine.step())
        if done and admitted:
            break
    assert done == admitted
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    engine.scheduler.drain()


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_a_long_queue_has_its_head_ordered_and_its_tail_kept(name):
    """Past the bound on how many requests are matched each step, the policy still orders the
    head of the queue (an offline batch of a few hundred requests would otherwise run in
    arrival order from start to end); the tail keeps arrival order behind it."""
    head = [req(f"none{i}", [7, 7, i]) for i in range(MAX_ORDERED - 1)] + [req("a", A + [1])]
    tail = [req("b", B + [1]), req("none-tail", [8, 8, 8])]
    assert order(name, cache_with(A, B), head + tail) == (
        ["a"] + [f"none{i}" for i in range(MAX_ORDERED - 1)] + ["b", "none-tail"]
    )
