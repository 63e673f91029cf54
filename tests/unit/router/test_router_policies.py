import typing

import pytest

from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.policies import (
    POLICY_NAMES,
    CacheAwarePolicy,
    CacheAwareSettings,
    Choice,
    PolicyName,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)
from kubesgl.router.workers import Role, Worker


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}:1", Role.MIXED, CircuitBreaker(), healthy=True) for i in range(n)]


def test_round_robin_cycles():
    pool = workers(3)
    policy = RoundRobinPolicy()
    assert [policy.choose(pool, "").worker for _ in range(6)] == pool + pool


def test_power_of_two_takes_the_less_loaded_of_two():
    pool = workers(2)
    pool[0].in_flight = 5
    policy = PowerOfTwoPolicy()
    assert all(policy.choose(pool, "").worker is pool[1] for _ in range(20))


def test_random_stays_in_the_pool():
    pool = workers(3)
    assert {RandomPolicy().choose(pool, "").worker for _ in range(200)} == set(pool)


def test_cache_aware_follows_the_prefix_then_spreads_new_ones():
    pool = workers(2)
    policy = CacheAwarePolicy()
    system_a, system_b = "A" * 100, "B" * 100
    first = policy.choose(pool, system_a + "q1")
    assert first.decision == "miss"
    again = policy.choose(pool, system_a + "q2")
    assert (again.worker, again.decision) == (first.worker, "hit")
    other = policy.choose(pool, system_b + "q1")
    assert other.decision == "miss" and other.worker is not first.worker  # the emptier tree


def test_cache_aware_hit_needs_the_match_rate_above_the_threshold():
    pool = workers(2)
    policy = CacheAwarePolicy(CacheAwareSettings(cache_threshold=0.5))
    first = policy.choose(pool, "shared" + "x" * 4)
    # 6 of 16 characters match (37%): a miss, so it goes to the worker holding less.
    second = policy.choose(pool, "shared" + "y" * 10)
    assert second.decision == "miss" and second.worker is not first.worker


def test_cache_aware_balances_when_both_thresholds_are_crossed():
    pool = workers(2)
    policy = CacheAwarePolicy(
        CacheAwareSettings(balance_abs_threshold=4, balance_rel_threshold=2.0)
    )
    owner = policy.choose(pool, "P" * 50).worker
    other = pool[1] if owner is pool[0] else pool[0]
    owner.in_flight, other.in_flight = 6, 3  # gap 3: within the absolute threshold
    assert policy.choose(pool, "P" * 50) == Choice(owner, "hit", cached=50)
    owner.in_flight = 10  # gap 7 > 4 and 10 > 3 * 2: imbalanced, the cache yields
    assert policy.choose(pool, "P" * 50) == Choice(other, "balance", cached=0)


def test_cache_aware_forgets_removed_workers():
    pool = workers(1)
    policy = CacheAwarePolicy()
    policy.choose(pool, "text")
    assert policy.tree(pool[0]).size == 4
    policy.forget(pool[0])
    assert policy.tree(pool[0]).size == 0


def test_policy_names_and_settings_are_checked():
    assert typing.get_args(PolicyName) == POLICY_NAMES  # the operator's spec takes PolicyName
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("cache_aware"), CacheAwarePolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError):
        CacheAwareSettings(cache_threshold=1.5)
    with pytest.raises(ValueError):
        CacheAwareSettings(balance_rel_threshold=0.5)


@pytest.mark.parametrize(("threshold", "spreads"), [(None, True), (64, False)])
def test_a_small_pool_spreads_after_a_worker_rejoins_by_default(threshold, spreads):
    """Issue 16, item 9: worker A holds the pool's one system prompt; B (re)joins empty. Eight
    requests behind that prompt arrive together: by default some reach B; with SGLang's 64 all
    stay on A (benchmarks/router/small_pool.py measures both on real engines)."""
    a, b = workers(2)
    settings = (
        CacheAwareSettings()
        if threshold is None
        else CacheAwareSettings(balance_abs_threshold=threshold)
    )
    policy = CacheAwarePolicy(settings)
    system = "You are a helpful assistant. " * 20
    assert policy.choose([a], system + "first question").worker is a
    for i in range(8):
        choice = policy.choose([a, b], system + f"question {i}")
        choice.worker.in_flight += 1  # none has finished yet
    assert (b.in_flight > 0) is spreads
    assert a.in_flight + b.in_flight == 8
    if spreads:
        assert b.in_flight >= 2


def test_cache_aware_forgets_a_worker_that_restarted():
    """A worker whose connection broke and that passes health checks again is a new process
    with an empty KV cache: its old prefixes are no hits there."""
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.routing import DisaggregationSettings, Forwarder, Policies, RetrySettings
    from kubesgl.router.upstream import UpstreamClient
    from kubesgl.router.workers import WorkerRegistry

    registry = WorkerRegistry()
    worker = registry.add("http://10.0.0.1:30000", Role.MIXED)
    registry.set_healthy(worker, True)
    policy = CacheAwarePolicy()
    metrics = RouterMetrics(registry)
    Forwarder(
        registry,
        Policies(policy, policy, policy),
        UpstreamClient(None, metrics),  # type: ignore[arg-type]
        metrics,
        RetrySettings(),
        DisaggregationSettings(),
    )
    prompt = "a long shared system prompt " * 10
    policy.choose([worker], prompt)
    registry.mark_lost(worker)
    assert policy.tree(worker).match_length(prompt) == len(prompt)  # maybe only a broken link
    registry.set_healthy(worker, True)
    assert policy.tree(worker).match_length(prompt) == 0
