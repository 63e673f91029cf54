"""KV transfer between two engines' pools over NIXL (UCX on host memory here): the slots of
every layer arrive where the decode side asked, in one WRITE whose descriptors merge runs of
consecutive slots, and the notification names the room."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from kubesgl.engine.disagg.kv_transfer import KVTransferAgent, Transfer, TransferError, slot_runs
from kubesgl.engine.kvcache.pools import KVPool


def test_slot_runs_merge_what_is_consecutive_on_both_sides():
    assert slot_runs([4, 5, 6, 9, 10, 3], [20, 21, 22, 23, 24, 30]) == [
        (4, 20, 3),
        (9, 23, 2),
        (3, 30, 1),
    ]
    assert slot_runs([], []) == []
    with pytest.raises(ValueError, match="3 source slots for 2"):
        slot_runs([1, 2, 3], [1, 2])


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return result


def test_write_moves_every_layer_into_the_destination_slots(filled_kv_pool):
    prefill_pool, decode_pool = filled_kv_pool(1, layers=3), filled_kv_pool(None, layers=3)
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


def cpu_seconds(threads: set[str]) -> float:
    """User and system CPU time of these threads of this process (Linux)."""
    ticks = 0
    for tid in threads:
        with contextlib.suppress(FileNotFoundError):
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        ),
    ],
)
def test_idle_agents_keep_no_core_busy(filled_kv_pool, device):
    """Each agent's progress thread sleeps between its workers' events, for pools in host
    memory and on a GPU alike: with NIXL's Python defaults it polled without pause, a core
    per idle engine rank."""
    torch.empty(0, device=device)  # the CUDA context's own threads start before the count
    before = set(os.listdir("/proc/self/task"))
    # held: the agents write into them
    pools = filled_kv_pool(1, device=device), filled_kv_pool(None, device=device)
    prefill, decode = KVTransferAgent(pools[0]), KVTransferAgent(pools[1])
    try:
        prefill.connect(decode.metadata, decode.layout)
        transfer = prefill.write(decode.name, [1, 2], [3, 4], b"room-1")
        wait(lambda: prefill.done(transfer))
        assert wait(decode.notifications) == [b"room-1"]
        agent_threads = set(os.listdir("/proc/self/task")) - before
        assert agent_threads, "the agents started no thread of their own"
        used = cpu_seconds(agent_threads)
        time.sleep(1.0)
        assert cpu_seconds(agent_threads) - used < 0.2
    finally:
        prefill.close()
        decode.close()


def test_pools_of_different_shapes_are_refused(filled_kv_pool):
    prefill = KVTransferAgent(filled_kv_pool(1, layers=3, kv_heads=2))
    decode = KVTransferAgent(filled_kv_pool(None, layers=3, kv_heads=4))
    try:
        with pytest.raises(
            ValueError,
            match=r"KV pools differ: 3 layers of slots \[2, 8\] bfloat16 here, 3 of \[4, 8\] bfloat16",
        ):
            prefill.connect(decode.metadata, decode.layout)
    finally:
        prefill.close()
        decode.close()


def test_slots_outside_the_pool_are_refused(filled_kv_pool):
    pools = filled_kv_pool(1), filled_kv_pool(None)  # held: the agents write into them
    prefill, decode = KVTransferAgent(pools[0]), KVTransferAgent(pools[1])
    try:
        prefill.connect(decode.metadata, decode.layout)
        with pytest.raises(ValueError, match="outside its pool"):
            prefill.write(decode.name, [1], [64], b"room")
    finally:
        prefill.close()
        decode.close()


def test_releasing_a_write_in_flight_does_not_stop_it(monkeypatch):
    """Why the prefill side never gives up on a write past its timeout but holds the room
    until NIXL says the write ended (prefill.py, WriteOverdue): releasing the handle of a
    write in flight leaves its puts running (UCX cancels receives only), so the KV still
    lands in the slots, which the decode side could have handed to another request."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read as an agent starts: slow enough to catch mid-way
    prefill_pool, decode_pool = (
        KVPool(32768, 2, 8, 128, torch.bfloat16, torch.device("cpu")) for _ in range(2)
    )
    for t in prefill_pool.k + prefill_pool.v:
        t.fill_(1)
    prefill, decode = KVTransferAgent(prefill_pool), KVTransferAgent(decode_pool)

    def landed() -> bool:
        return all(bool(t.all()) for t in decode_pool.k + decode_pool.v)

    started = False
    try:
        prefill.connect(decode.metadata, decode.layout)
        slots = list(range(32768))  # 256 MiB over all layers, a tenth of a second or more
        transfer = prefill.write(decode.name, slots, slots, b"room-7")
        started = True
        state = prefill.agent.check_xfer_state(transfer.handle)
        prefill.agent.release_xfer_handle(transfer.handle)
        last_slot_landed = bool(decode_pool.v[-1][-1].any())
        assert state == "PROC" and not last_slot_landed, "the write ended before its release"
    finally:
        if started:  # never deregister memory that puts may still land in or read from
            with contextlib.suppress(AssertionError):
                wait(landed)
        prefill.close()
        decode.close()
    assert landed()


class FailingNixl:
    """Stands in for an agent's NIXL calls that fail for a peer that died (named in `dead`):
    records the handles released, the agents removed and the memory deregistered, which
    the real agent then does."""

    def __init__(self, agent: KVTransferAgent, monkeypatch, dead: tuple[str, ...] = ()):
        self.dead, self.released, self.removed, self.deregistered = dead, [], [], []
        real = agent.agent
        real_remove, real_deregister = real.remove_remote_agent, real.deregister_memory

        def remove(peer: str) -> None:
            self.removed.append(peer)
            if peer in self.dead:
                self.fail()
            real_remove(peer)

        def deregister(registered) -> None:
            self.deregistered.append(registered)
            real_deregister(registered)

        monkeypatch.setattr(real, "check_xfer_state", self.fail)
        monkeypatch.setattr(real, "release_xfer_handle", self.released.append)
        monkeypatch.setattr(real, "remove_remote_agent", remove)
        monkeypatch.setattr(real, "deregister_memory", deregister)

    def fail(self, *args) -> None:
        raise RuntimeError("nixlRemoteDisconnectError")


def test_a_write_whose_check_fails_releases_its_handle(filled_kv_pool, monkeypatch):
    """A check of the transfer's state that raised left its handle never released: one
    leaked per failed write."""
    agent = KVTransferAgent(filled_kv_pool(None))
    try:
        nixl = FailingNixl(agent, monkeypatch)
        handle = object()
        with pytest.raises(TransferError, match="nixlRemoteDisconnectError"):
            agent.done(Transfer(handle, descriptors=1, nbytes=8))
        assert nixl.released == [handle]
    finally:
        agent.close()


def test_closing_past_a_peer_that_cannot_be_removed_still_frees_the_memory(
    filled_kv_pool, monkeypatch, caplog
):
    """One peer whose removal raised (its engine died) stopped the close: the peers after it
    were not removed and the pool's memory stayed registered."""
    prefill, decode = KVTransferAgent(filled_kv_pool(1)), KVTransferAgent(filled_kv_pool(None))
    try:
        prefill.connect(decode.metadata, decode.layout)
        prefill.peers = {"kubesgl-gone": decode.layout, **prefill.peers}  # the dead one first
        nixl = FailingNixl(prefill, monkeypatch, dead=("kubesgl-gone",))
        prefill.close()
        assert nixl.removed == ["kubesgl-gone", decode.name] and not prefill.peers
        assert len(nixl.deregistered) == 1
        assert "removing the agent kubesgl-gone" in caplog.text
    finally:
        decode.close()
