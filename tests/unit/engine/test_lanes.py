"""AddressLanes: a bounded pool of threads, a few at a time per address."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from kubesgl.engine.disagg.lanes import AddressLanes


def test_an_address_past_its_share_waits_in_order_and_leaves_the_others_threads():
    lanes = AddressLanes(workers=2, per_address=1, name="test-lanes")
    stalled, ran = threading.Event(), []
    try:
        held = [lanes.submit("hung", stalled.wait, 10)]
        queued = [lanes.submit("hung", ran.append, n) for n in range(3)]
        assert lanes.submit("other", lambda: "went").result(timeout=2) == "went"
        assert not any(f.done() for f in held + queued)  # beyond its share: no thread taken
        stalled.set()
        for future in queued:
            future.result(timeout=2)
        assert ran == [0, 1, 2]  # one at a time, in the order submitted
    finally:
        stalled.set()
        lanes.close()


def test_work_submitted_after_close_never_runs():
    lanes = AddressLanes(workers=2, per_address=1, name="test-lanes")
    lanes.close()
    assert lanes.submit("a", pytest.fail, "ran").cancelled()


def test_close_cancels_the_work_not_started_so_nothing_waits_on_it_forever():
    lanes = AddressLanes(workers=2, per_address=1, name="test-lanes")
    stalled = threading.Event()
    try:
        running = lanes.submit("hung", stalled.wait, 10)
        other = lanes.submit("other", stalled.wait, 10)
        waiting_in_its_lane = lanes.submit("hung", pytest.fail, "ran")
        lanes.close()
        assert waiting_in_its_lane.cancelled()
        stalled.set()
        assert running.result(timeout=2) and other.result(timeout=2)
    finally:
        stalled.set()
        lanes.close()


def test_work_queued_on_the_pool_when_it_closes_is_cancelled_not_run():
    lanes = AddressLanes(workers=2, per_address=1, name="test-lanes")
    stalled = threading.Event()
    try:
        held = [lanes.submit(address, stalled.wait, 10) for address in ("a", "b")]
        queued = lanes.submit("c", pytest.fail, "ran")  # no thread free: queued on the pool
        lanes.close()
        stalled.set()
        for future in held:
            future.result(timeout=2)
        with pytest.raises(CancelledError):
            queued.result(timeout=2)
    finally:
        stalled.set()
        lanes.close()


def test_a_share_that_leaves_no_thread_for_the_others_is_refused():
    with pytest.raises(ValueError, match="leaves none for the others"):
        AddressLanes(workers=2, per_address=2, name="test-lanes")
