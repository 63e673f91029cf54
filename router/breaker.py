"""Per-worker circuit breaker: stop sending requests to a worker that keeps failing them.

Closed: requests flow. After `failure_threshold` consecutive failures it opens and the worker
gets no requests for `cooldown_s`. Then it is half-open: one trial request may go; its
success closes it, its failure opens it for another cooldown, and if it ends without a
verdict (cancelled, or answered with a client's 4xx error) another may go. Health checks are
a separate signal (a worker can answer /health and still fail every request), except that a
worker re-entering the pool after it left it gets a new breaker (WorkerRegistry.set_healthy):
it may be a restarted process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5
    cooldown_s: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    consecutive_failures: int = 0
    opened_at: float | None = None
    trial_running: bool = False  # half-open: the one request let through has not ended

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self.opened_at < self.cooldown_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows_requests(self) -> bool:
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self.trial_running
        )

    def begin(self) -> bool:
        """A request is sent to the worker; True when it is the half-open trial, whose end
        (`end_trial`) lets the next one through."""
        if self.state is BreakerState.HALF_OPEN and not self.trial_running:
            self.trial_running = True
            return True
        return False

    def claim_trial(self) -> Trial | None:
        """`begin` for a request whose worker is chosen now: the trial is its own from here,
        also while it waits for a connection slot, when others choosing would take it too."""
        return Trial(self) if self.begin() else None

    def end_trial(self) -> None:
        self.trial_running = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None

    def record_failure(self, *, open_now: bool = False) -> None:
        """`open_now`: a failure that every request until the worker recovers would repeat, at
        a cost to each (a hung P/D prefill engine), opens the circuit whatever the threshold."""
        self.consecutive_failures += 1
        was_trial = self.state is BreakerState.HALF_OPEN
        if open_now or was_trial or self.consecutive_failures >= self.failure_threshold:
            self.opened_at = self.clock()


@dataclass(eq=False)
class Trial:
    """A half-open breaker's one trial, claimed by a request (`claim_trial`); ended once, by the
    request's end or, if it was never sent, by its abandonment: a later trial's claim on the
    same breaker is not ended by this one's."""

    breaker: CircuitBreaker
    ended: bool = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.breaker.end_trial()
