"""P/D mode with no prefill worker that can serve: a decode worker prefills each request itself.

A trial's prefill engine died: once health checks marked it failing, the router refused every
request with a 503 (and its /health went 503, taking a Kubernetes router pod out of Ready)
while the decode pool, which prefills a request without a bootstrap room itself, was healthy.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from upstream_fakes import LONG_PROMPT, RecordingUpstream, round_robin_forwarder

from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.errors import RouterError
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.routing import Forwarder
from kubesgl.router.workers import Role, Worker, WorkerRegistry

PREFILL, DECODE = "http://10.0.0.1:30000", "http://10.0.0.2:30000"


def _forwarder(*roles: Role) -> tuple[Forwarder, RecordingUpstream, dict[Role, Worker]]:
    registry = WorkerRegistry(make_breaker=lambda: CircuitBreaker(1, 60.0))
    urls = {Role.PREFILL: PREFILL, Role.DECODE: DECODE}
    workers = {role: registry.add(urls[role], role) for role in roles}
    for worker in workers.values():
        registry.set_healthy(worker, True)
    upstream = RecordingUpstream()
    forwarder = round_robin_forwarder(registry, upstream)
    return forwarder, upstream, workers


def _send(forwarder: Forwarder, prompt: str = LONG_PROMPT, model: str = "m") -> None:
    body = json.dumps({"model": model, "prompt": prompt}).encode()
    asyncio.run(forwarder.generate(parse_generation_request("/v1/completions", body), []))


def _routes(forwarder: Forwarder) -> dict[str, float]:
    return {
        sample.labels["route"]: sample.value
        for family in forwarder.metrics.registry.collect()
        if family.name == "kubesgl_router_pd_routes"
        for sample in family.samples
    }


def _fail_health(forwarder: Forwarder, worker: Worker) -> None:
    worker.health_failures = 2  # as the health checker counts before it takes one out
    forwarder.workers.set_healthy(worker, False)


def test_a_worker_not_checked_yet_is_named_so_not_failing():
    """A worker whose first check had not run was counted as failing health checks, which
    sent users looking for a fault in a healthy engine."""
    forwarder, _, workers = _forwarder(Role.PREFILL, Role.DECODE)
    fresh = forwarder.workers.add("http://10.0.0.3:30000", Role.DECODE)
    _fail_health(forwarder, workers[Role.DECODE])
    assert forwarder.no_worker_error(Role.DECODE).message == (
        "no decode worker can serve: 2 registered, 1 failing health checks, 1 not "
        "health-checked yet, 0 with an open circuit breaker"
    )
    assert fresh.unchecked and not workers[Role.DECODE].unchecked
    # one of --health-success-threshold 2 passed: neither new nor failing
    fresh.health_successes = 1
    assert forwarder.no_worker_error(Role.DECODE).message == (
        "no decode worker can serve: 2 registered, 1 failing health checks, 1 passing health "
        "checks, not back yet, 0 with an open circuit breaker"
    )


def _open_breaker(forwarder: Forwarder, worker: Worker) -> None:
    worker.breaker.record_failure()


@pytest.mark.parametrize("outage", [_fail_health, _open_breaker], ids=["unhealthy", "breaker"])
def test_a_long_prompt_goes_to_a_decode_worker_alone_while_no_prefill_worker_can_serve(outage):
    forwarder, upstream, workers = _forwarder(Role.PREFILL, Role.DECODE)
    outage(forwarder, workers[Role.PREFILL])
    _send(forwarder)
    [(worker, body)] = upstream.sent
    assert worker is workers[Role.DECODE] and "bootstrap_room" not in body
    assert _routes(forwarder)["decode_only_no_prefill"] == 1


def test_a_decode_pool_without_any_prefill_worker_serves_alone():
    forwarder, upstream, workers = _forwarder(Role.DECODE)
    _send(forwarder)
    assert [w for w, _ in upstream.sent] == [workers[Role.DECODE]]
    assert _routes(forwarder)["decode_only_no_prefill"] == 1


def test_a_request_its_only_prefill_worker_refused_is_retried_on_a_decode_worker_alone():
    """The prefill worker refused it before any work (a 503: draining, say): the retry goes to
    a decode worker alone instead of back to the prefill worker that refused it."""
    forwarder, upstream, workers = _forwarder(Role.PREFILL, Role.DECODE)
    upstream.prefill_refuses = True
    _send(forwarder)
    roles = [(w.role, "bootstrap_room" in body) for w, body in upstream.sent]
    assert roles[-1] == (Role.DECODE, False)
    assert roles.count((Role.PREFILL, True)) == 1  # not asked again
    assert _routes(forwarder) == {
        "disaggregated": 0,
        "decode_only_short": 0,
        "decode_only_saturated": 0,
        "decode_only_no_prefill": 1,
        "decode_only_incompatible": 0,
    }


def test_a_short_prompt_still_counts_as_short_without_a_prefill_worker():
    forwarder, _, workers = _forwarder(Role.PREFILL, Role.DECODE)
    _fail_health(forwarder, workers[Role.PREFILL])
    _send(forwarder, prompt="hi")
    assert _routes(forwarder)["decode_only_short"] == 1
    assert _routes(forwarder)["decode_only_no_prefill"] == 0


def test_without_a_decode_worker_the_request_is_still_refused():
    forwarder, _, workers = _forwarder(Role.PREFILL, Role.DECODE)
    _fail_health(forwarder, workers[Role.DECODE])
    with pytest.raises(RouterError) as refused:
        _send(forwarder)
    assert refused.value.status == 503
    assert refused.value.message.startswith("no decode worker can serve")


def test_the_outage_is_logged_as_it_starts_and_ends_not_per_request(caplog):
    forwarder, _, workers = _forwarder(Role.PREFILL, Role.DECODE)
    caplog.set_level(logging.INFO, logger="kubesgl.router")
    _fail_health(forwarder, workers[Role.PREFILL])
    caplog.clear()
    for _ in range(3):
        _send(forwarder)
    forwarder.workers.set_healthy(workers[Role.PREFILL], True)
    for _ in range(2):
        _send(forwarder)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "no prefill worker can serve: 1 registered, 1 failing health checks, 0 with an open "
        "circuit breaker (model 'm'): requests go to a decode worker alone, which prefills "
        "them itself",
        f"worker {PREFILL} is now healthy",
        "a prefill worker can serve (model 'm') again: requests are handed over again",
    ]


def test_the_outages_of_models_no_decode_worker_serves_any_more_are_forgotten():
    """The decode engine restarts under one name after another while no prefill worker can
    serve: each name's outage was kept for good, one more for each name ever served."""
    forwarder, _, workers = _forwarder(Role.PREFILL, Role.DECODE)
    _fail_health(forwarder, workers[Role.PREFILL])
    for i in range(50):
        workers[Role.DECODE].models = (f"m{i}",)
        _send(forwarder, model=f"m{i}")
    assert forwarder._prefill_outages._models == {"m49"}
