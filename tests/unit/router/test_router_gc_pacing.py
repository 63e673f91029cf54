"""The router starts its process's garbage-collection pacer (kubesgl/gc_pacing.py) at the end
of start-up and tells it whether requests are in flight."""

from __future__ import annotations

import asyncio

import pytest

from kubesgl.router.app import RouterApp
from kubesgl.router.config import RouterConfig
from kubesgl.router.workers import Role


@pytest.mark.asyncio
async def test_the_router_paces_its_garbage_collector_by_the_requests_in_flight(
    recording_pacer,
):
    pacer = recording_pacer
    app = RouterApp(RouterConfig(), pacer)  # type: ignore[arg-type]
    assert pacer.started == 0
    await app.startup()
    try:
        await asyncio.sleep(0.05)
        assert pacer.started == 1 and pacer.ticks and not any(pacer.ticks)
        worker = app.workers.add("http://127.0.0.1:9", Role.MIXED)
        worker.in_flight = 1
        await asyncio.sleep(0.05)
        assert pacer.ticks[-1] is True
        worker.in_flight = 0
        await asyncio.sleep(0.05)
        assert pacer.ticks[-1] is False
    finally:
        await app.shutdown()
