"""KV slots between engines over NIXL (docs/disaggregation.md, the KV write).

Each engine registers the K and V buffers of every layer of its pool with a NIXL agent. The
decode side hands the prefill side its agent metadata and its `PoolLayout`; the prefill side
then writes a request's slots of every layer into the decode side's slots with one NIXL
WRITE, whose descriptors cover runs of slots that are consecutive on both sides, and the
transfer's notification (the room) tells the decode side it is complete. NIXL moves host
memory (DRAM) for pools on the CPU and device memory (VRAM) for pools on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass

from kubesgl.engine.disagg.protocol import PoolLayout
from kubesgl.engine.kvcache.pools import KVPool

logger = logging.getLogger(__name__)


def layout_of(pool: KVPool, agent: str) -> PoolLayout:
    """Where `pool`'s buffers are, as a peer must know to write into them."""
    first = pool.k[0]
    return PoolLayout(
        agent=agent,
        memory="VRAM" if first.device.type == "cuda" else "DRAM",
        device_id=first.device.index or 0,
        slot_bytes=first[0].numel() * first.element_size(),
        slot_shape=tuple(first.shape[1:]),
        dtype=str(first.dtype).removeprefix("torch."),
        num_slots=pool.num_slots,
        k_addresses=tuple(t.data_ptr() for t in pool.k),
        v_addresses=tuple(t.data_ptr() for t in pool.v),
    )


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) of the runs where both lists count up by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class TransferError(RuntimeError):
    """NIXL could not do what was asked (a peer that disconnected, a failed write, ...)."""


@contextlib.contextmanager
def _nixl(what: str):
    """NIXL's bindings raise plain Exceptions of their own (nixlRemoteDisconnectError, ...):
    one request's failed transfer, never a reason for the engine to stop."""
    try:
        yield
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - see above
        raise TransferError(f"{what}: {type(exc).__name__}: {exc}") from exc


@dataclass
class Transfer:
    handle: object
    descriptors: int  # per side
    nbytes: int


# How long UCX's progress thread waits for its workers' events between passes. NIXL's Python
# API sets no wait (pthrDelay 0), which the thread runs as poll() with a zero timeout: a core
# kept busy by every idle engine rank (both cores of a laptop running the quickstart). The
# thread wakes on the workers' events whatever the wait, so the wait only bounds how late it
# sees an event UCX did not signal: writes between two processes take no longer with it, in
# host memory and on an H100 alike (benchmarks/README.md, "NIXL's progress thread").
PROGRESS_THREAD_DELAY_US = 1000


def _nixl_agent(name: str, progress_delay_us: int):
    """A NIXL agent with the UCX backend whose progress thread waits `progress_delay_us`
    between passes (PROGRESS_THREAD_DELAY_US; benchmarks/kv_write_progress.py gives others). The Python API (nixl 1.5.1) has no option for that wait, so its C++
    agent is replaced, before any backend exists, by one configured alike but with the wait
    set (tests/unit/engine/test_kv_transfer.py notices a NIXL where this stops working)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    from nixl._bindings import nixlAgent, nixlAgentConfig

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    config = nixlAgentConfig()
    config.useProgThread, config.useListenThread = True, False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value  # the API's default
    config.pthrDelay = progress_delay_us
    agent.agent = nixlAgent(name, config)
    agent.create_backend("UCX", {})
    return agent


class KVTransferAgent:
    """One engine's NIXL agent over its KV pool."""

    def __init__(self, pool: KVPool, name: str | None = None):
        self.name = name or f"kubesgl-{uuid.uuid4().hex[:12]}"  # unique among its peers
        self.layout = layout = layout_of(pool, self.name)
        self.agent = _nixl_agent(self.name, PROGRESS_THREAD_DELAY_US)
        buffers = [
            (address, layout.num_slots * layout.slot_bytes, layout.device_id, "")
            for address in layout.k_addresses + layout.v_addresses
        ]
        self._registered = self.agent.register_memory(buffers, layout.memory)
        self.peers: dict[str, PoolLayout] = {}

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, peer_metadata: bytes, peer: PoolLayout) -> None:
        self.layout.check_compatible(peer)
        with _nixl("adding the peer's agent"):
            name = self.agent.add_remote_agent(peer_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.agent:
            raise ValueError(
                f"NIXL metadata of agent {name!r} came with the layout of {peer.agent!r}"
            )
        self.peers[peer.agent] = peer

    def disconnect(self, peer_name: str) -> None:
        """Forgets a peer's agent (its metadata and UCX endpoints)."""
        self.peers.pop(peer_name, None)
        with _nixl(f"removing the agent {peer_name}"):
            self.agent.remove_remote_agent(peer_name)

    def write(
        self, peer_name: str, src_slots: list[int], dst_slots: list[int], notification: bytes
    ) -> Transfer:
        """Starts writing slots `src_slots` of every layer here into `dst_slots` at the peer."""
        peer = self.peers[peer_name]
        if (
            max(dst_slots, default=0) >= peer.num_slots
            or max(src_slots, default=0) >= self.layout.num_slots
        ):
            raise ValueError("a slot is outside its pool")
        size = self.layout.slot_bytes
        local, remote = [], []
        for s, d, n in slot_runs(src_slots, dst_slots):
            for here, there in zip(
                self.layout.k_addresses + self.layout.v_addresses,
                peer.k_addresses + peer.v_addresses,
            ):
                local.append((here + s * size, n * size, self.layout.device_id))
                remote.append((there + d * size, n * size, peer.device_id))
        with _nixl(f"starting the KV write to {peer.agent}"):
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, self.layout.memory),
                self.agent.get_xfer_descs(remote, peer.memory),
                peer.agent,
                notification,
            )
            try:
                started = self.agent.transfer(handle)
            except Exception:
                self.agent.release_xfer_handle(handle)
                raise
            if started == "ERR":
                self.agent.release_xfer_handle(handle)
                raise TransferError(f"NIXL could not start the KV write to {peer.agent}")
        return Transfer(handle, len(local), sum(length for _, length, _ in local))

    def done(self, transfer: Transfer) -> bool:
        """True once the transfer has completed (its handle is then released); raises if it failed."""
        with _nixl("the KV write"):
            try:
                state = self.agent.check_xfer_state(transfer.handle)
            except Exception:  # the write failed all the same: nothing checks its handle again
                self.agent.release_xfer_handle(transfer.handle)
                raise
            if state == "PROC":
                return False
            self.agent.release_xfer_handle(transfer.handle)
        if state != "DONE":
            raise TransferError(f"the KV write failed ({state})")
        return True

    def notify(self, peer_name: str, message: bytes) -> None:
        """A notification without a transfer (a room that ends without its KV)."""
        with _nixl(f"notifying {peer_name}"):
            self.agent.send_notif(peer_name, message)

    def notifications(self) -> list[bytes]:
        """Notifications of transfers peers completed into this pool, since the last call."""
        with _nixl("reading notifications"):
            return [
                message for messages in self.agent.get_new_notifs().values() for message in messages
            ]

    def close(self) -> None:
        """Forgets every peer, then the pool's memory: a peer that cannot be removed (its
        engine died) is logged and leaves the others and the memory to be released."""
        try:
            for peer in self.peers:
                try:
                    self.agent.remove_remote_agent(peer)
                except Exception as exc:  # noqa: BLE001 - NIXL's own errors, see _nixl
                    logger.warning("removing the agent %s: %s: %s", peer, type(exc).__name__, exc)
            self.peers.clear()
        finally:
            self.agent.deregister_memory(self._registered)
