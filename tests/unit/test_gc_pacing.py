"""The serving processes' garbage-collection pacing (kubesgl/gc_pacing.py): start-up objects
frozen, no automatic full collections, full ones when idle and at most every so often under
load."""

from __future__ import annotations

import gc

import pytest

from kubesgl.gc_pacing import GcPacer


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def test_after_start_objects_that_live_long_bring_no_full_collection(restore_gc):
    # CPython runs a full pass once the objects promoted since the last one pass a quarter of
    # the old generation: as many new survivors as the process tracks always get there
    count = len(gc.get_objects()) + 100_000

    def keep_many_alive() -> list:
        return [[i] for i in range(count)]  # each survives the young collections

    before = full_collections()
    kept = keep_many_alive()
    assert full_collections() > before  # CPython's own pacing: full passes as the heap grows
    del kept
    GcPacer().start()
    assert gc.get_freeze_count() > 0 and gc.isenabled()
    before, young_before = full_collections(), gc.get_stats()[0]["collections"]
    keep_many_alive()
    assert full_collections() == before
    assert gc.get_stats()[0]["collections"] > young_before  # the young ones still run


def test_a_full_collection_once_idle_for_a_while_and_once_per_interval_under_load(
    restore_gc, monkeypatch
):
    collections: list[float] = []
    clock = Clock()
    pacer = GcPacer(idle_after_s=1.0, busy_every_s=600.0, clock=clock)
    pacer.start()
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(clock.now) or 0)

    def run(seconds: float, busy: bool, step: float = 0.5) -> None:
        end = clock.now + seconds
        while clock.now < end:
            clock.now += step
            pacer.tick(busy)

    run(599, busy=True)
    assert collections == []
    run(2, busy=True)
    assert collections == [600.0]  # under sustained load: once per interval
    run(0.5, busy=False)
    assert collections == [600.0]  # idle, but not for long yet
    run(5, busy=False)
    assert collections == [600.0, 602.5]  # idle for a second: once, not again while idle
    run(1, busy=True)
    run(3, busy=False)
    assert collections == [600.0, 602.5, 609.0]  # the next idle period gets its own
