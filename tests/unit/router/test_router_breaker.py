import pytest

from kubesgl.router.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_recovers_through_half_open():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # a success resets the count
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.allows_requests()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows_requests()
    clock.now += 10
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_requests()
    breaker.record_failure()  # the trial failed: open again at once
    assert breaker.state is BreakerState.OPEN
    clock.now += 10
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_half_open_lets_one_trial_request_through_at_a_time():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure()
    clock.now += 10
    assert breaker.allows_requests()
    assert breaker.begin()  # the trial is sent
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows_requests()
    breaker.end_trial()  # its client left: no verdict, another trial may go
    assert breaker.allows_requests()
    assert breaker.begin()
    breaker.end_trial()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allows_requests()
    assert not breaker.begin() and not breaker.begin()  # closed: no trial, any number
    assert breaker.allows_requests()


def test_a_request_sent_before_half_open_does_not_end_the_trial():
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.upstream import Attempt
    from kubesgl.router.workers import Role, Worker, WorkerRegistry

    clock = Clock()
    worker = Worker("http://w:1", Role.MIXED, CircuitBreaker(1, cooldown_s=10, clock=clock))
    metrics = RouterMetrics(WorkerRegistry())
    early = Attempt(worker, metrics)  # sent while closed
    Attempt(worker, metrics).finish("500", worker_failed=True)  # opens the circuit
    clock.now += 10
    trial = Attempt(worker, metrics)
    early.finish("cancelled", worker_failed=None)
    assert not worker.breaker.allows_requests()  # the trial still runs: no second one
    trial.finish("200", worker_failed=False)
    assert worker.breaker.state is BreakerState.CLOSED


def test_a_cancelled_request_says_nothing_of_the_worker():
    """A client that gives up on a slow, failing worker must not reset its failure count."""
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.upstream import Attempt
    from kubesgl.router.workers import Role, Worker, WorkerRegistry

    worker = Worker("http://w:1", Role.MIXED, CircuitBreaker(failure_threshold=2))
    metrics = RouterMetrics(WorkerRegistry())
    Attempt(worker, metrics).finish("500", worker_failed=True)
    Attempt(worker, metrics).finish("cancelled", worker_failed=None)
    assert worker.breaker.consecutive_failures == 1
    Attempt(worker, metrics).finish("500", worker_failed=True)
    assert worker.breaker.state is BreakerState.OPEN and worker.in_flight == 0


def pool_of_one(role: str, failure_threshold: int):
    """(clock, registry, metrics, worker): a registry of one healthy worker whose breakers
    open after `failure_threshold` failures and cool down for 10 s of `clock`."""
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.workers import Role, WorkerRegistry

    clock = Clock()
    registry = WorkerRegistry(
        make_breaker=lambda: CircuitBreaker(failure_threshold, cooldown_s=10, clock=clock)
    )
    worker = registry.add("http://w:1", Role(role))
    registry.set_healthy(worker, True)
    return clock, registry, RouterMetrics(registry), worker


def test_a_worker_that_re_enters_the_pool_gets_a_closed_breaker():
    """A crash fails every request in flight, each a failure for the breaker; the restarted
    worker that passes its health checks again must serve a burst, not one trial at a time."""
    from kubesgl.router.upstream import Attempt

    clock, registry, metrics, worker = pool_of_one("decode", 5)
    cut = [Attempt(worker, metrics) for _ in range(8)]
    straggler = cut.pop()  # its end comes only after the restart
    for attempt in cut:  # the crash: connections break, the worker leaves the pool
        registry.mark_lost(worker)
        attempt.finish("error", worker_failed=True)
    assert worker.breaker.state is BreakerState.OPEN and not worker.can_serve()
    clock.now += 10  # half-open by now: one trial at a time, were the breaker kept
    registry.set_healthy(worker, True)  # health checks pass again
    assert worker.breaker.state is BreakerState.CLOSED and worker.breaker.consecutive_failures == 0
    burst = [Attempt(worker, metrics) for _ in range(6)]
    assert worker.can_serve() and registry.available(worker.role) == [worker]
    straggler.finish("error", worker_failed=True)  # sent to the old process: not counted
    assert worker.breaker.consecutive_failures == 0
    for attempt in burst:
        attempt.finish("200", worker_failed=False)
    assert worker.in_flight == 0


def test_a_worker_that_stays_in_the_pool_keeps_its_open_breaker():
    """Health checks that keep passing do not close the circuit of a worker that answers 5xx."""
    from kubesgl.router.upstream import Attempt

    clock, registry, metrics, worker = pool_of_one("mixed", 2)
    for _ in range(2):
        Attempt(worker, metrics).finish("500", worker_failed=True)
    registry.set_healthy(worker, True)  # another passing check: no change of state
    assert worker.breaker.state is BreakerState.OPEN and not worker.can_serve()
    clock.now += 10
    trial = Attempt(worker, metrics)
    registry.set_healthy(worker, True)
    assert not worker.can_serve()  # half-open, its one trial running
    trial.finish("500", worker_failed=True)
    assert worker.breaker.state is BreakerState.OPEN


def test_a_worker_that_only_failed_health_checks_keeps_its_breaker():
    """Health checks that time out under load and pass again are no restart: a worker that
    answers 5xx and flaps so must not get a closed circuit each time it comes back."""
    from kubesgl.router.upstream import Attempt

    clock, registry, metrics, worker = pool_of_one("mixed", 2)
    for _ in range(2):
        Attempt(worker, metrics).finish("500", worker_failed=True)
    registry.set_healthy(worker, False, "its health check timed out")
    registry.set_healthy(worker, True)
    assert worker.breaker.state is BreakerState.OPEN and not worker.can_serve()


class _Answer:
    """An aiohttp response of a worker that answers at once with `status`."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.raw_headers = [(b"content-type", b"application/json")]

    async def read(self) -> bytes:
        return b'{"error": {"message": "answered %d"}}' % self.status

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Session:
    """A connection pool whose worker answers each request with the next status."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses

    async def request(self, method, url, data, headers, **kwargs):
        return _Answer(self.statuses.pop(0))


def test_a_client_error_answer_counts_neither_way():
    """4xx answers are the client's fault (docs/router.md): one between failures reset the
    failure count, and a half-open trial answered 4xx closed the circuit of a failing worker."""
    import asyncio

    from kubesgl.router.upstream import UpstreamClient, UpstreamError

    clock, registry, metrics, worker = pool_of_one("mixed", 5)
    statuses = [500] * 4 + [400] + [500, 404]
    client = UpstreamClient(_Session(statuses), metrics)  # type: ignore[arg-type]

    async def send() -> int:
        try:
            await client.exchange(worker, "POST", "/v1/completions", b"{}", [], stream=False)
        except UpstreamError as error:
            return error.status
        return 200

    for _ in range(5):
        asyncio.run(send())
    assert worker.breaker.consecutive_failures == 4 and worker.breaker.state is BreakerState.CLOSED
    asyncio.run(send())  # the fifth failure in a row: the 400 did not reset the count
    assert worker.breaker.state is BreakerState.OPEN
    clock.now += 10
    assert asyncio.run(send()) == 404  # the half-open trial: a client's error
    assert worker.breaker.state is BreakerState.HALF_OPEN and worker.breaker.allows_requests()
    assert worker.in_flight == 0


def test_an_attempt_on_a_removed_worker_counts_nowhere_once_its_url_is_back():
    """A pod turns unready mid-request and ready again at the same address: the new worker's
    series must not count the old worker's request (docs/router.md, Metrics)."""
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.upstream import Attempt
    from kubesgl.router.workers import Role, WorkerRegistry

    registry = WorkerRegistry()
    metrics = RouterMetrics(registry)
    old = registry.add("http://10.0.0.5:30000", Role.MIXED, source="kubernetes", pod="p")
    running = Attempt(old, metrics)
    registry.remove(old.url, pod="p")
    new = registry.add("http://10.0.0.5:30000", Role.MIXED, source="kubernetes", pod="p")
    running.finish("500", worker_failed=True)
    labels = {"worker": new.url, "status": "500"}
    assert metrics.registry.get_sample_value("kubesgl_router_requests_total", labels) is None
    assert new.breaker.consecutive_failures == 0 and new.in_flight == 0
    Attempt(new, metrics).finish("500", worker_failed=True)  # the new worker's own: counted
    assert metrics.registry.get_sample_value("kubesgl_router_requests_total", labels) == 1


class _CountingSession:
    """Workers that answer every request at once; `sent` lists the URLs asked."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def request(self, method, url, data, headers, **kwargs):
        from upstream_fakes import Answer

        self.sent.append(url.rsplit("/v1/", 1)[0])
        return Answer(200, b'{"choices": [{"text": "ok"}]}')


def _half_open_trial_race(roles: list[str]) -> tuple[list[str], list[object]]:
    """Two requests chosen while every connection slot is held, the first worker's circuit
    half-open: the URLs the requests reached once the slots are free, and their outcomes."""
    import asyncio
    import json

    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.policies import RoundRobinPolicy
    from kubesgl.router.request_parsing import parse_generation_request
    from kubesgl.router.routing import DisaggregationSettings, Forwarder, Policies, RetrySettings
    from kubesgl.router.upstream import ConnectionSlots, UpstreamClient
    from kubesgl.router.workers import Role, WorkerRegistry

    clock = Clock()
    registry = WorkerRegistry(make_breaker=lambda: CircuitBreaker(1, cooldown_s=10, clock=clock))
    workers = [registry.add(f"http://10.0.0.{i + 1}:30000", Role(r)) for i, r in enumerate(roles)]
    for worker in workers:
        registry.set_healthy(worker, True)
    workers[0].breaker.record_failure()
    clock.now += 10  # past its cooldown: half-open, one trial may go
    session = _CountingSession()
    slots = ConnectionSlots(2, wait_s=1.0)
    client = UpstreamClient(session, RouterMetrics(registry), slots=slots)  # type: ignore[arg-type]
    policies = Policies(RoundRobinPolicy(), RoundRobinPolicy(), RoundRobinPolicy())
    forwarder = Forwarder(
        registry,
        policies,
        client,
        client.metrics,
        RetrySettings(max_retries=0),
        DisaggregationSettings(),
    )
    body = {"model": "m", "prompt": "word " * 400}
    request = parse_generation_request("/v1/completions", json.dumps(body).encode())

    async def run() -> list[object]:
        held = await slots.acquire_together(2)
        sends = [asyncio.create_task(forwarder.generate(request, [])) for _ in range(2)]
        await asyncio.sleep(0.01)  # both chose their workers and wait for slots
        for release in held:
            release()
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        await forwarder.aclose()
        return outcomes

    outcomes = asyncio.run(run())
    return session.sent, outcomes


def test_a_half_open_worker_gets_one_trial_while_requests_wait_for_a_connection():
    """The trial is the chosen request's from its choice on: one that waits for a slot keeps
    other requests off the worker, which must not get a second "trial" meanwhile."""
    from kubesgl.router.errors import RouterError

    sent, outcomes = _half_open_trial_race(["mixed"])
    assert sent == ["http://10.0.0.1:30000"]
    assert isinstance(outcomes[1], RouterError) and outcomes[1].status == 503


def test_a_half_open_prefill_worker_gets_one_trial_while_pairs_wait_for_connections():
    """P/D: the pair's requests start in tasks after its slots are free; the second request
    meanwhile finds no prefill worker and goes to the decode worker alone."""
    sent, outcomes = _half_open_trial_race(["prefill", "decode"])
    assert sent.count("http://10.0.0.1:30000") == 1
    assert sent.count("http://10.0.0.2:30000") == 2
    assert not any(isinstance(outcome, Exception) for outcome in outcomes)


def test_a_trial_that_found_no_free_connection_lets_the_next_request_be_the_trial():
    import asyncio

    from kubesgl.router.errors import RouterError
    from kubesgl.router.upstream import ConnectionSlots, UpstreamClient

    clock, registry, metrics, worker = pool_of_one("mixed", 1)
    worker.breaker.record_failure()
    clock.now += 10
    slots = ConnectionSlots(1, wait_s=0.01)
    client = UpstreamClient(_CountingSession(), metrics, slots=slots)  # type: ignore[arg-type]

    async def run() -> None:
        held = await slots.acquire()
        with pytest.raises(RouterError):  # pool_full: never sent
            await client.exchange(worker, "POST", "/v1/completions", b"{}", [], stream=False)
        held()

    asyncio.run(run())
    assert worker.breaker.allows_requests() and worker.in_flight == 0
