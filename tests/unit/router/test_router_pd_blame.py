"""In P/D mode the failure of one side of a pair is counted against that side alone.

An engine whose partner failed a room answers 502 itself (engine/scheduler/roles.py): a decode
engine whose prefill failed, a prefill engine whose decode engine died. That answer is the
other side's failure, not its own; counted as the worker's, one bad prefill worker opened the
circuits of the healthy decode workers it was paired with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from upstream_fakes import Answer, Cancelled, error_answer

from kubesgl.router.breaker import BreakerState, CircuitBreaker
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.pd import PrefillDecodePair
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.upstream import UpstreamClient, UpstreamError
from kubesgl.router.workers import Role, WorkerRegistry

PREFILL, DECODE = "http://10.0.0.1:30000", "http://10.0.0.2:30000"

Side = Callable[[], Awaitable[Answer]]


class _Session:
    """Answers each worker's request with its side's script; room cancels are accepted."""

    def __init__(self, prefill: Side, decode: Side) -> None:
        self.sides = {PREFILL: prefill, DECODE: decode}

    async def request(self, method, url, data, headers, **kwargs):
        return await self.sides[url.rsplit("/v1/", 1)[0]]()

    def delete(self, url, **kwargs):
        return Cancelled()


def after(delay_s: float, status: int, message: str = "") -> Side:
    async def answer() -> Answer:
        await asyncio.sleep(delay_s)
        if status == 200:
            return Answer(200, json.dumps({"choices": [{"text": "ok"}]}).encode())
        return error_answer(status, message)

    return answer


def disconnected_after(delay_s: float) -> Side:
    async def answer() -> Answer:
        await asyncio.sleep(delay_s)
        raise aiohttp.ServerDisconnectedError()

    return answer


def pair(failure_threshold: int = 5):
    registry = WorkerRegistry(make_breaker=lambda: CircuitBreaker(failure_threshold, 10.0))
    prefill = registry.add(PREFILL, Role.PREFILL, 8998)
    decode = registry.add(DECODE, Role.DECODE)
    return registry, RouterMetrics(registry), prefill, decode


def send(metrics: RouterMetrics, session: _Session, prefill, decode) -> UpstreamError | None:
    request = parse_generation_request(
        "/v1/completions", json.dumps({"model": "m", "prompt": "a long prompt"}).encode()
    )

    async def once() -> UpstreamError | None:
        client = UpstreamClient(session, metrics)  # type: ignore[arg-type]
        try:
            await PrefillDecodePair(client).exchange(request, prefill, decode, [])
        except UpstreamError as error:
            return error
        finally:
            await asyncio.sleep(0.05)  # background room cancels end
        return None

    return asyncio.run(once())


def counted(metrics: RouterMetrics, url: str, status: str) -> float:
    value = metrics.registry.get_sample_value(
        "kubesgl_router_requests_total", {"worker": url, "status": status}
    )
    return value or 0.0


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_failing_prefill_is_blamed_not_the_decode_that_answered_for_it(prefill_first):
    """The prefill engine fails its room; the decode engine answers 502 (its peer failed),
    before or after the prefill's own 500 reaches the router."""
    _, metrics, prefill, decode = pair(failure_threshold=3)
    prefill_delay, decode_delay = (0.0, 0.02) if prefill_first else (0.02, 0.0)
    for _ in range(3):
        session = _Session(
            after(prefill_delay, 500, "the prefill engine failed"),
            after(decode_delay, 502, "room 1 failed at the prefill engine"),
        )
        error = send(metrics, session, prefill, decode)
        assert error is not None and error.worker is prefill and error.status == 500
    assert prefill.breaker.state is BreakerState.OPEN
    assert decode.breaker.state is BreakerState.CLOSED
    assert decode.breaker.consecutive_failures == 0
    assert prefill.in_flight == decode.in_flight == 0
    assert counted(metrics, PREFILL, "500") == 3
    # the decode engine's 502 was its partner's failure: counted as cancelled, no error of its own
    assert counted(metrics, DECODE, "502") == 0 and counted(metrics, DECODE, "cancelled") == 3


def test_a_dying_decode_is_blamed_not_the_prefill_that_answered_for_it():
    """The decode engine's connection breaks; the prefill engine, whose decode engine died,
    fails the room and answers 502, before the router hears of the broken connection."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(after(0.0, 502, "the decode engine died"), disconnected_after(0.02))
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is decode
    assert decode.breaker.state is BreakerState.OPEN
    assert prefill.breaker.state is BreakerState.CLOSED
    assert counted(metrics, PREFILL, "502") == 0 and counted(metrics, DECODE, "error") == 1


def test_a_decode_that_fails_by_itself_is_blamed_not_the_prefill_it_told():
    """The decode engine fails the request itself (a 500) and its prefill engine, told of the
    cancelled room, answers 502 first: the decode engine's failure is the cause."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(after(0.0, 502, "the decode engine failed the room"), after(0.02, 500))
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is decode and error.status == 500
    assert decode.breaker.state is BreakerState.OPEN
    assert prefill.breaker.state is BreakerState.CLOSED
    assert prefill.in_flight == decode.in_flight == 0


def test_a_prefill_that_fails_after_the_decode_answered_is_still_blamed():
    """Once the decode engine has answered, the prefill's failure is its own (it is logged)."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(after(0.02, 500, "the prefill engine failed late"), after(0.0, 200))
    assert send(metrics, session, prefill, decode) is None
    assert prefill.breaker.state is BreakerState.OPEN
    assert decode.breaker.state is BreakerState.CLOSED and prefill.in_flight == 0
    assert counted(metrics, PREFILL, "500") == 1 and counted(metrics, DECODE, "200") == 1


@pytest.mark.parametrize("decode_status", [502, 504])
def test_a_prefill_silent_while_its_decode_names_its_failure_is_blamed_and_retryable(
    decode_status,
):
    """The decode engine answers that its room failed at the prefill engine (its post to a
    hung prefill engine's bootstrap server timed out: 502 "could not be reached ...
    ReadTimeout"; or the room timed out: 504), whose own answer does not come within the
    verdict's wait: the prefill worker failed. Unreachable (502), its circuit opens at once,
    whatever --breaker-failure-threshold (each request sent to it until then would wait out
    the decode engine's post timeout, some 11 s, before its retry); a room that timed out
    (504) may be a prefill engine merely busy with a deep queue, one failure towards the
    threshold (an open circuit would shut it out for the cooldown). The decode engine answered
    an error before any output, so the error is retryable without that prefill worker; the
    decode's attempt only passed the failure on (`cancelled`): one failed attempt counted,
    the prefill's, as `error` (no answer of its own, as a request the router timed out)."""
    _, metrics, prefill, decode = pair()
    session = _Session(
        after(5.0, 200),
        after(
            0.0, decode_status, "the prefill engine at http://10.0.0.1:8998 could not be reached"
        ),
    )
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is prefill and error.status == decode_status
    assert error.retryable
    assert error.message.startswith(f"decode worker {DECODE} answered {decode_status}: ")
    assert "could not be reached" in error.message and PREFILL in error.message
    opened = decode_status == 502
    assert prefill.breaker.state is (BreakerState.OPEN if opened else BreakerState.CLOSED)
    assert prefill.breaker.consecutive_failures == 1
    assert decode.breaker.state is BreakerState.CLOSED
    assert decode.breaker.consecutive_failures == 0
    assert counted(metrics, PREFILL, "error") == 1 and counted(metrics, PREFILL, "cancelled") == 0
    assert counted(metrics, DECODE, "cancelled") == 1
    assert counted(metrics, DECODE, str(decode_status)) == 0
    assert prefill.in_flight == decode.in_flight == 0


def test_a_decode_that_names_a_prefill_failure_the_prefill_denies_is_counted_by_its_status():
    """The prefill request answered 200 (its part done, as far as it knows) and the decode
    engine answers 502, naming a prefill failure: the router cannot tell whose failure it
    was, so no breaker is told, but the client's 502 is counted under its status on the
    decode worker (as `cancelled` it was in no 5xx series: an alert on 5xx missed it)."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(after(0.0, 200), after(0.02, 502, "the KV note did not arrive"))
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is decode and error.status == 502
    assert not error.retryable
    assert counted(metrics, DECODE, "502") == 1 and counted(metrics, DECODE, "cancelled") == 0
    assert counted(metrics, PREFILL, "200") == 1
    assert decode.breaker.state is prefill.breaker.state is BreakerState.CLOSED
    assert decode.breaker.consecutive_failures == 0
    assert prefill.in_flight == decode.in_flight == 0


@pytest.mark.parametrize("decode_status", [502, 504])
def test_a_decode_that_never_asked_for_its_room_is_blamed_not_the_prefill_that_timed_it_out(
    decode_status,
):
    """The decode engine stalls past the timeout: the prefill engine gives up on the room
    (504, no decode engine asked for it), and the decode engine, resumed, answers 502 or 504
    with that failure. The prefill's error tells the client what happened; the decode's stall
    was the cause, and a healthy prefill worker's circuit stays closed."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(
        after(0.0, 504, "no decode engine asked for room 1 within 60 s"),
        after(0.02, decode_status, "room 1 failed at the prefill engine"),
    )
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is prefill and error.status == 504
    assert prefill.breaker.state is BreakerState.CLOSED
    assert decode.breaker.state is BreakerState.OPEN
    assert counted(metrics, PREFILL, "cancelled") == 1
    assert counted(metrics, DECODE, str(decode_status)) == 1
    assert prefill.in_flight == decode.in_flight == 0


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_prefill_409_for_the_room_its_decode_closed_is_no_error_of_the_prefill(prefill_first):
    """A trial's `max_tokens: 10**9`: the decode engine refuses it (400) and closes its room,
    which the prefill engine then answers 409. The client gets the decode's 400; the prefill's
    409 only passed that refusal on, and counted as its own it made a client's mistake look
    like a prefill-side error."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    prefill_delay, decode_delay = (0.0, 0.02) if prefill_first else (0.02, 0.0)
    session = _Session(
        after(prefill_delay, 409, "bootstrap_room 1 was cancelled by its decode engine"),
        after(decode_delay, 400, "lower max_tokens to at most 2034"),
    )
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is decode and error.status == 400
    assert counted(metrics, DECODE, "400") == 1
    assert counted(metrics, PREFILL, "409") == 0 and counted(metrics, PREFILL, "cancelled") == 1
    assert decode.breaker.state is prefill.breaker.state is BreakerState.CLOSED
    assert prefill.in_flight == decode.in_flight == 0


def test_a_prefill_409_the_decode_does_not_explain_is_counted_as_the_prefills():
    """The decode engine says nothing within the verdict's wait: the prefill's 409 is the
    client's answer, and its own (a client's error: its breaker is not told)."""
    _, metrics, prefill, decode = pair(failure_threshold=1)
    session = _Session(after(0.0, 409, "bootstrap_room 1 is already in use"), after(5.0, 200))
    error = send(metrics, session, prefill, decode)
    assert error is not None and error.worker is prefill and error.status == 409
    assert counted(metrics, PREFILL, "409") == 1 and counted(metrics, DECODE, "cancelled") == 1
    assert (
        prefill.breaker.state is BreakerState.CLOSED and prefill.breaker.consecutive_failures == 0
    )
    assert prefill.in_flight == decode.in_flight == 0
