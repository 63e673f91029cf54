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
