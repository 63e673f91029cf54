"""CUDA graphs are captured with the garbage collector paused (executor/cuda_graph.py): a
graph of an engine dropped earlier in the process, destroyed by a collection in the middle of
a capture, invalidates that capture."""

from __future__ import annotations

import gc

import pytest

from kubesgl.engine.executor.cuda_graph import collector_paused


class _Cycle:
    """Garbage only the collector frees (it refers to itself), which says when it goes."""

    def __init__(self, name: str, freed: list[str]):
        self.name, self.freed, self.me = name, freed, self

    def __del__(self):
        self.freed.append(self.name)


def _allocate_enough_to_trigger_a_collection() -> list:
    # kept alive: each container freed at once would lower the count that makes a collection due
    return [[] for _ in range(10 * gc.get_threshold()[0])]


def test_the_allocations_do_trigger_a_collection_with_the_collector_on():
    freed: list[str] = []
    _Cycle("garbage", freed)
    _allocate_enough_to_trigger_a_collection()
    assert freed == ["garbage"]


def test_earlier_garbage_goes_before_the_capture_and_nothing_is_collected_during_it():
    freed: list[str] = []
    _Cycle("before", freed)
    assert gc.isenabled()
    with collector_paused():
        assert freed == ["before"] and not gc.isenabled()
        _Cycle("during", freed)
        _allocate_enough_to_trigger_a_collection()
        assert freed == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert freed == ["before", "during"]


def test_the_collector_is_back_after_a_failed_capture_and_stays_off_if_it_was():
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
