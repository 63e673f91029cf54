"""P/D mode pairs a decode worker only with prefill workers of its KV layout (the fingerprint
its /health names, contract.KV_LAYOUT_HEADER): a prefill engine refuses a decode engine of
another pool layout with a 502, and a rollout of another model, dtype, KV cache dtype or
tensor-parallel size replaces the two pools independently, old prefill paired with new decode
and back for the whole rollout. A worker that names no layout (SGLang's engines, one not
checked yet) pairs with any; a decode worker with no prefill worker of its layout serves
alone, prefilling each request itself."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from upstream_fakes import LONG_PROMPT, RecordingUpstream, round_robin_forwarder

from kubesgl.contract import KV_LAYOUT_HEADER
from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.health import HealthChecker, HealthSettings
from kubesgl.router.request_parsing import parse_generation_request
from kubesgl.router.routing import DisaggregationSettings, Forwarder
from kubesgl.router.workers import Role, Worker, WorkerRegistry

OLD, NEW = "kv1-00000000000000aa", "kv1-00000000000000bb"


def _forwarder(
    prefills: list[str | None], decodes: list[str | None]
) -> tuple[Forwarder, RecordingUpstream, list[Worker], list[Worker]]:
    """Workers of those KV layouts (None: one not named), every one healthy."""
    registry = WorkerRegistry(make_breaker=lambda: CircuitBreaker(1, 60.0))

    def add(role: Role, host: int, layout: str | None) -> Worker:
        worker = registry.add(f"http://10.0.{host}.1:30000", role)
        worker.kv_layout = layout
        registry.set_healthy(worker, True)
        return worker

    p = [add(Role.PREFILL, i, layout) for i, layout in enumerate(prefills)]
    d = [add(Role.DECODE, 100 + i, layout) for i, layout in enumerate(decodes)]
    upstream = RecordingUpstream()
    forwarder = round_robin_forwarder(registry, upstream)
    return forwarder, upstream, p, d


def _send(forwarder: Forwarder, model: str = "m") -> None:
    body = json.dumps({"model": model, "prompt": LONG_PROMPT}).encode()
    asyncio.run(forwarder.generate(parse_generation_request("/v1/completions", body), []))


def _pairs(upstream: RecordingUpstream) -> list[tuple[str, str | None]]:
    """(decode worker, the prefill worker it was paired with, or None: alone) of each request."""
    by_room: dict[object, str] = {}
    pairs = []
    for worker, body in upstream.sent:
        room = body.get("bootstrap_room")
        if worker.role is Role.PREFILL:
            by_room[room] = worker.url
        else:
            pairs.append((worker.url, by_room.get(room) if room is not None else None))
    return pairs


def _routes(forwarder: Forwarder) -> dict[str, float]:
    return {
        sample.labels["route"]: sample.value
        for family in forwarder.metrics.registry.collect()
        if family.name == "kubesgl_router_pd_routes"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_a_decode_worker_is_paired_only_with_prefill_workers_of_its_layout():
    """Half a rollout: an old and a new prefill worker, a new and an old decode worker (the
    round-robin policies alone would pair each with the other layout's)."""
    forwarder, upstream, (p_old, p_new), (d_new, d_old) = _forwarder([OLD, NEW], [NEW, OLD])
    for _ in range(8):
        _send(forwarder)
    pairs = _pairs(upstream)
    assert len(pairs) == 8
    assert set(pairs) == {(d_old.url, p_old.url), (d_new.url, p_new.url)}
    assert _routes(forwarder)["disaggregated"] == 8


def test_a_worker_that_names_no_layout_pairs_with_any():
    forwarder, upstream, (p_old, p_none, _), (d,) = _forwarder([OLD, None, NEW], [OLD])
    for _ in range(6):
        _send(forwarder)
    assert {prefill for _, prefill in _pairs(upstream)} == {p_old.url, p_none.url}
    forwarder, upstream, (p_old, p_new), (d,) = _forwarder([OLD, NEW], [None])
    for _ in range(4):
        _send(forwarder)
    assert {prefill for _, prefill in _pairs(upstream)} == {p_old.url, p_new.url}


def test_layouts_of_another_fingerprint_scheme_pair():
    """Another version's way of making the fingerprint tells nothing about the layout."""
    forwarder, upstream, (p_other, _), (d,) = _forwarder(["kv2-1234", NEW], [OLD])
    for _ in range(4):
        _send(forwarder)
    assert set(_pairs(upstream)) == {(d.url, p_other.url)}


def test_a_decode_worker_without_a_prefill_worker_of_its_layout_serves_alone():
    forwarder, upstream, (p_old,), (d_old, d_new) = _forwarder([OLD], [OLD, NEW])
    for _ in range(4):
        _send(forwarder)
    assert sorted(_pairs(upstream)) == sorted([(d_old.url, p_old.url), (d_new.url, None)] * 2)
    assert not any("bootstrap_room" in body for w, body in upstream.sent if w is d_new)
    assert _routes(forwarder) == {
        "disaggregated": 2,
        "decode_only_short": 0,
        "decode_only_saturated": 0,
        "decode_only_no_prefill": 0,
        "decode_only_incompatible": 2,
    }


def test_no_prefill_worker_at_all_is_still_decode_only_no_prefill():
    forwarder, _, (p,), _ = _forwarder([OLD], [NEW])
    forwarder.workers.set_healthy(p, False)
    _send(forwarder)
    assert _routes(forwarder)["decode_only_no_prefill"] == 1
    assert _routes(forwarder)["decode_only_incompatible"] == 0


def test_saturation_is_judged_on_the_prefill_workers_of_its_layout():
    forwarder, upstream, (p_old, p_new), (d,) = _forwarder([OLD, NEW], [NEW])
    p_new.in_flight = DisaggregationSettings().max_prefill_in_flight  # p_old idle, of no use
    _send(forwarder)
    assert _pairs(upstream) == [(d.url, None)]
    assert _routes(forwarder)["decode_only_saturated"] == 1


@pytest.mark.parametrize("model", ["m", "other"])
def test_a_pool_without_a_pair_is_logged_as_it_starts_and_ends_not_per_request(caplog, model):
    forwarder, _, (p,), (d,) = _forwarder([OLD], [NEW])
    caplog.set_level(logging.INFO, logger="kubesgl.router")
    for _ in range(3):
        _send(forwarder, model)
    p.kv_layout = NEW  # its engine restarted in the new layout
    for _ in range(2):
        _send(forwarder, model)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"no prefill worker that can serve (model {model!r}) has the KV layout {NEW} of decode "
        f"worker {d.url} (theirs: {OLD}): requests go to the decode workers of that layout "
        "alone, which prefill them itself, until one has (a rollout of another model, dtype, KV "
        "cache dtype or tensor-parallel size under way?)",
        f"a prefill worker of KV layout {NEW} can serve (model {model!r}) again: requests are "
        "handed over again",
    ]


def test_the_unpaired_layouts_of_gone_decode_workers_are_forgotten():
    forwarder, _, _, (d,) = _forwarder([OLD], [NEW])
    for i in range(50):
        d.kv_layout = f"kv1-{i:016x}"
        _send(forwarder)
    assert forwarder._kv_layouts._unpaired == {("m", d.kv_layout)}


def test_each_passed_health_check_keeps_the_layout_its_answer_names():
    """A worker's layout is what its last passed check named: a failed check (a restart under
    way) keeps it, a passed check without the header (an engine that names none) forgets it."""
    answers = [(200, OLD), (503, None), (200, NEW), (200, None)]

    async def go() -> list[str | None]:
        async def health(_: web.Request) -> web.Response:
            status, layout = answers.pop(0)
            return web.Response(
                status=status, headers={KV_LAYOUT_HEADER: layout} if layout else None
            )

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        workers = WorkerRegistry()
        worker = workers.add(f"http://127.0.0.1:{runner.addresses[0][1]}", Role.DECODE)
        worker.models = ("m",)  # named already: no /v1/models asked
        seen = []
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(workers, session, HealthSettings())
            await checker.probe_soon(worker)  # a check of it, as the health loop makes
            seen.append(worker.kv_layout)
            for _ in range(3):
                await checker.check(worker)
                seen.append(worker.kv_layout)
        await runner.cleanup()
        return seen

    assert asyncio.run(go()) == [OLD, OLD, NEW, None]
