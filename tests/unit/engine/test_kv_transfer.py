"""KV transfer between two engines' pools over NIXL (UCX on host memory here): the slots of
every layer arrive where the decode side asked, in one WRITE whose descriptors merge runs of
consecutive slots, and the notification names the room."""

from __future__ import annotations

import time

import pytest
import torch

from kubesgl.engine.disagg.kv_transfer import KVTransferAgent, slot_runs
from kubesgl.engine.kvcache.pools import KVPool


def pool(seed: int | None, layers: int = 3, kv_heads: int = 2, head_dim: int = 8, dtype=torch.bfloat16) -> KVPool:
    p = KVPool(64, layers, kv_heads, head_dim, dtype, torch.device("cpu"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in p.k + p.v:
            t.copy_(torch.randn(t.shape, generator=gen))
    return p


def test_slot_runs_merge_what_is_consecutive_on_both_sides():
    assert slot_runs([4, 5, 6, 9, 10, 3], [20, 21, 22, 23, 24, 30]) == [(4, 20, 3), (9, 23, 2), (3, 30, 1)]
    assert slot_runs([], []) == []
    with pytest.raises(ValueError, match="3 source slots for 2"):
        slot_runs([1, 2, 3], [1, 2])


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return result


def test_write_moves_every_layer_into_the_destination_slots():
    prefill_pool, decode_pool = pool(seed=1), pool(seed=None)
    prefill, decode = KVTransferAgent(prefill_pool), KVTransferAgent(decode_pool)
    try:
        prefill.connect(decode.metadata, decode.layout)
        src, dst = [7, 8, 9, 10, 30, 2], [40, 41, 42, 43, 11, 12]
        transfer = prefill.write(decode.name, src, dst, b"room-123")
        assert transfer.descriptors == 3 * 2 * 3  # 3 runs, K and V, 3 layers
        assert transfer.nbytes == len(src) * 2 * 3 * 2 * 8 * 2
        wait(lambda: prefill.done(transfer))
        assert wait(decode.notifications) == [b"room-123"]
        for here, there in zip(prefill_pool.k + prefill_pool.v, decode_pool.k + decode_pool.v):
            assert torch.equal(there[dst], here[src])
            untouched = torch.ones(64, dtype=torch.bool)
            untouched[dst] = False
            assert not there[untouched].any()
    finally:
        prefill.close()
        decode.close()


def test_pools_of_different_shapes_are_refused():
    prefill, decode = KVTransferAgent(pool(1, kv_heads=2)), KVTransferAgent(pool(None, kv_heads=4))
    try:
        with pytest.raises(ValueError, match="KV pools differ: 3 layers of 32 bytes per slot here, 3 of 64"):
            prefill.connect(decode.metadata, decode.layout)
    finally:
        prefill.close()
        decode.close()


def test_slots_outside_the_pool_are_refused():
    prefill, decode = KVTransferAgent(pool(1)), KVTransferAgent(pool(None))
    try:
        prefill.connect(decode.metadata, decode.layout)
        with pytest.raises(ValueError, match="outside its pool"):
            prefill.write(decode.name, [1], [64], b"room")
    finally:
        prefill.close()
        decode.close()
