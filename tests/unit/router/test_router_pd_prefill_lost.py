"""P/D mode: a request whose prefill engine died under it (its connection broke) goes once more.

The router answered 502 at once: a request that reached an engine and broke there may be the
one that broke it. But the decode engine then only passed on the failure (502 for the room its
prefill engine never served) and the client had nothing yet, so another pair or a decode
worker alone could serve it; once, as a request that kills each prefill engine it reaches must
not visit them all.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from upstream_fakes import Answer, Cancelled, error_answer

from kubesgl.router.breaker import BreakerState, CircuitBreaker
from kubesgl.router.metrics import PDRoute, RouterMetrics
from kubesgl.router.policies import RoundRobinPolicy
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.routing import DisaggregationSettings, Forwarder, Policies, RetrySettings
from kubesgl.router.upstream import Reply, StreamingReply, UpstreamClient, UpstreamError
from kubesgl.router.workers import Role, WorkerRegistry

DECODE = "http://10.0.0.9:30000"
LONG_PROMPT = "word " * 400  # ~500 tokens: handed over whenever a prefill worker can take it


class _Session:
    """Every prefill engine dies under its request; a decode engine fails a request with a
    room for want of its KV (after the prefill's connection broke, as its heartbeat finds a
    dead prefill engine), unless `decode_status` says otherwise, and serves one without a room
    (a decode worker alone)."""

    def __init__(self, decode_status: int = 502) -> None:
        self.decode_status = decode_status
        self.sent: list[tuple[str, bool]] = []  # (worker URL, with a room)

    async def request(self, method, url, data, headers, **kwargs):
        worker = url.rsplit("/v1/", 1)[0]
        paired = "bootstrap_room" in json.loads(data)
        self.sent.append((worker, paired))
        if worker != DECODE:
            raise aiohttp.ServerDisconnectedError()
        if not paired:
            return Answer(200, b'data: {"choices": [{"text": "ok"}]}\n\ndata: [DONE]\n\n')
        await asyncio.sleep(0.02)
        message = "room 1: the prefill engine at 10.0.0.1:8998 died"
        return error_answer(self.decode_status, message)

    def delete(self, url, **kwargs):
        return Cancelled()


def _forwarder(
    prefills: int, session: _Session, max_retries: int = 3
) -> tuple[Forwarder, WorkerRegistry]:
    registry = WorkerRegistry(make_breaker=lambda: CircuitBreaker(5, 60.0))
    for i in range(prefills):
        registry.add(f"http://10.0.0.{i + 1}:30000", Role.PREFILL, 8998)
    registry.add(DECODE, Role.DECODE)
    for worker in registry.all():
        registry.set_healthy(worker, True)
    metrics = RouterMetrics(registry)
    client = UpstreamClient(session, metrics, on_worker_lost=registry.mark_lost)  # type: ignore[arg-type]
    policies = Policies(RoundRobinPolicy(), RoundRobinPolicy(), RoundRobinPolicy())
    forwarder = Forwarder(
        registry,
        policies,
        client,
        metrics,
        RetrySettings(max_retries=max_retries, initial_backoff_s=0, max_backoff_s=0),
        DisaggregationSettings(),
    )
    return forwarder, registry


def _send(forwarder: Forwarder, stream: bool = False) -> Reply | UpstreamError:
    body = {"model": "m", "prompt": LONG_PROMPT, "stream": stream}
    request = parse_generation_request("/v1/completions", json.dumps(body).encode())

    async def send() -> Reply | UpstreamError:
        try:
            reply = await forwarder.generate(request, [])
            if isinstance(reply, StreamingReply):
                async for _ in reply.chunks:
                    pass
            return reply
        except UpstreamError as error:
            return error
        finally:
            await forwarder.aclose()  # the room cancels end

    return asyncio.run(send())


def _sample(forwarder: Forwarder, name: str, **labels: str) -> float:
    return forwarder.metrics.registry.get_sample_value(name, labels) or 0.0


def _counted(forwarder: Forwarder, url: str, status: str) -> float:
    return _sample(forwarder, "kubesgl_router_requests_total", worker=url, status=status)


def _routes(forwarder: Forwarder) -> dict[str, float]:
    """The P/D routes counted, each route by name (every series, those at 0 too)."""
    return {
        route.value: _sample(forwarder, "kubesgl_router_pd_routes_total", route=route.value)
        for route in PDRoute
    }


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_a_request_its_prefill_engine_died_under_is_served_by_a_decode_worker_alone(stream):
    session = _Session()
    forwarder, registry = _forwarder(1, session)
    [prefill] = registry.with_role(Role.PREFILL)
    [decode] = registry.with_role(Role.DECODE)
    reply = _send(forwarder, stream)
    assert not isinstance(reply, UpstreamError) and reply.status == 200
    assert session.sent[-1] == (DECODE, False)
    # the dead prefill is blamed (and out of the pool), the decode that passed it on is not
    assert prefill.breaker.consecutive_failures == 1 and not prefill.healthy
    assert _counted(forwarder, prefill.url, "error") == 1
    assert decode.breaker.consecutive_failures == 0
    assert _counted(forwarder, DECODE, "cancelled") == 1 and _counted(forwarder, DECODE, "502") == 0
    assert _counted(forwarder, DECODE, "200") == 1
    assert _sample(forwarder, "kubesgl_router_retries_total") == 1
    routes = {"disaggregated": 0, "decode_only_no_prefill": 1}
    for route, count in routes.items():
        assert _sample(forwarder, "kubesgl_router_pd_routes_total", route=route) == count
    assert prefill.in_flight == decode.in_flight == 0


def test_a_request_that_kills_each_prefill_engine_it_reaches_is_tried_on_two_only():
    """Another prefill worker can take the retry (another pair); when it dies too, the
    request is taken for the cause: its client gets that prefill worker's error."""
    session = _Session()
    forwarder, registry = _forwarder(3, session)
    error = _send(forwarder)
    assert isinstance(error, UpstreamError) and error.status == 502
    assert error.worker.role is Role.PREFILL and "failed: ServerDisconnectedError" in error.message
    reached = [url for url, _ in session.sent if url != DECODE]
    assert len(reached) == len(set(reached)) == 2
    assert _sample(forwarder, "kubesgl_router_retries_total") == 1
    [decode] = registry.with_role(Role.DECODE)
    assert decode.breaker.state is BreakerState.CLOSED
    assert decode.breaker.consecutive_failures == 0
    # the route counted once, for the attempt that answered the client: the first attempt's
    # was left to its retry, the retry's error is the answer and counts its own
    assert _routes(forwarder) == {route.value: 0 for route in PDRoute} | {"disaggregated": 1}


def test_a_request_its_prefill_engine_died_under_with_no_retry_allowed_counts_its_route():
    """With --max-retries 0 the first attempt's error is the client's answer: no retry counts
    the route for it."""
    session = _Session()
    forwarder, _ = _forwarder(2, session, max_retries=0)
    error = _send(forwarder)
    assert isinstance(error, UpstreamError) and error.status == 502
    assert len([url for url, _ in session.sent if url != DECODE]) == 1
    assert _sample(forwarder, "kubesgl_router_retries_total") == 0
    assert _routes(forwarder) == {route.value: 0 for route in PDRoute} | {"disaggregated": 1}


def test_a_decode_engine_that_fails_by_itself_as_its_prefill_dies_is_not_retried():
    """A decode engine's own 500 is its answer about the request, no failure passed on."""
    session = _Session(decode_status=500)
    forwarder, registry = _forwarder(2, session)
    error = _send(forwarder)
    assert isinstance(error, UpstreamError)
    assert len([url for url, _ in session.sent if url != DECODE]) == 1
    assert _sample(forwarder, "kubesgl_router_retries_total") == 0
