"""The connection limit (--max-connections) of P/D pairs: a pair takes its two slots at once,
and no cancellation, wherever it comes, keeps a slot."""

from __future__ import annotations

import asyncio
import json

from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.pd import PrefillDecodePair
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.upstream import ConnectionSlots, UpstreamClient
from kubesgl.router.workers import Role, WorkerRegistry


class _SilentSession:
    """Workers that never answer."""

    async def request(self, method, url, data, headers, **kwargs):
        await asyncio.Event().wait()


def test_a_pair_cancelled_while_waiting_for_its_second_slot_keeps_none():
    async def run() -> None:
        slots = ConnectionSlots(2, wait_s=5.0)
        other = await slots.acquire()
        waiting = asyncio.create_task(slots.acquire_together(2))
        await asyncio.sleep(0.01)  # it has the free slot and waits for the other's
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        other()
        async with asyncio.timeout(0.1):  # both free
            for release in await slots.acquire_together(2):
                release()

    asyncio.run(run())


def test_a_pair_cancelled_at_any_step_leaks_no_slot():
    """Cancelled right as it took its slots (its requests' tasks not started: they never ran
    the code that releases them), or while its requests are open."""
    registry = WorkerRegistry()
    prefill = registry.add("http://10.0.0.1:30000", Role.PREFILL, 8998)
    decode = registry.add("http://10.0.0.2:30000", Role.DECODE)
    request = parse_generation_request(
        "/v1/completions", json.dumps({"model": "m", "prompt": "a prompt"}).encode()
    )

    async def run(steps: int) -> None:
        slots = ConnectionSlots(2, wait_s=0.1)
        client = UpstreamClient(_SilentSession(), RouterMetrics(registry), slots=slots)  # type: ignore[arg-type]
        exchange = asyncio.create_task(
            PrefillDecodePair(client).exchange(request, prefill, decode, [])
        )
        for _ in range(steps):
            await asyncio.sleep(0)
        exchange.cancel()
        await asyncio.gather(exchange, return_exceptions=True)
        for release in await slots.acquire_together(2):  # pool_full if one was kept
            release()

    for steps in range(1, 6):
        asyncio.run(run(steps))
    assert prefill.in_flight == decode.in_flight == 0
