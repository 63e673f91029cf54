"""The P/D handshake and transfer layer on one machine, without schedulers: a decode side
registers with a prefill side's bootstrap server over HTTP and posts rooms; the prefill side
writes the prompt's KV into the posted slots with the first token in the notification, and
every way a room can end reaches the other side, with the decode side's slots released only
once no write into them can come."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
import torch

from kubesgl.engine.disagg import bootstrap_client, bootstrap_server
from kubesgl.engine.disagg.bootstrap_client import BootstrapClient
from kubesgl.engine.disagg.bootstrap_server import BootstrapServer
from kubesgl.engine.disagg.decode import DecodeTransfers, NoteArrived
from kubesgl.engine.disagg.kv_transfer import KVTransferAgent, TransferError
from kubesgl.engine.disagg.link import LocalLink
from kubesgl.engine.disagg.prefill import ClosingTurn, PrefillTransfers
from kubesgl.engine.disagg.protocol import (
    CancelBody,
    ConnectBootstrap,
    FailureReason,
    PeerConnected,
    PeerRegistered,
    PeerRegistration,
    PoolLayout,
    PostRoom,
    RankAgent,
    RoomEnded,
    RoomNote,
    RoomPostBody,
    RoomsBody,
    RoomsQueued,
    RoomStatus,
    RoomWriting,
    ServeBootstrap,
    StillQueued,
)
from kubesgl.engine.disagg.ranks import RankConsensus
from kubesgl.engine.messages import BootstrapTarget


class Pair:
    """A prefill side and a decode side over loopback, each as one rank."""

    def __init__(
        self,
        filled_kv_pool,
        timeout: float,
        decode_kv_heads: int = 2,
        port: int = 0,
        dead_after_s: float = 10.0,
        decode_timeout: float | None = None,  # the decode side's, when not `timeout`
    ):
        self.prefill_pool, self.decode_pool = (
            filled_kv_pool(1),
            filled_kv_pool(None, kv_heads=decode_kv_heads),
        )
        self.prefill_agent, self.decode_agent = (
            KVTransferAgent(self.prefill_pool),
            KVTransferAgent(self.decode_pool),
        )
        self.prefill = PrefillTransfers(
            self.prefill_agent, RankConsensus(), LocalLink(), timeout, "127.0.0.1", port
        )
        self.server = self.prefill.link.service.server
        self.prefill_closed = False
        connect = ConnectBootstrap(
            "decode-test",
            (RankAgent(self.decode_agent.metadata, self.decode_agent.layout),),
            heartbeat_s=0.1,
            dead_after_s=dead_after_s,
        )
        self.decode = DecodeTransfers(
            self.decode_agent, RankConsensus(), LocalLink(), decode_timeout or timeout, connect
        )

    @property
    def client(self) -> BootstrapClient:
        """The decode side's bootstrap client, which its link runs in this process."""
        client = self.decode.link.service.side
        assert isinstance(client, BootstrapClient), "ConnectBootstrap comes first"
        return client

    def target(self, room: int) -> BootstrapTarget:
        return BootstrapTarget(room, "127.0.0.1", self.server.port)

    def run(self, until, timeout: float = 15.0):
        """Poll both sides like two schedulers would until `until(sent, arrived)`."""
        sent, arrived = [], []
        deadline = time.monotonic() + timeout
        while not until(sent, arrived):
            assert time.monotonic() < deadline, f"timed out with {sent} {arrived}"
            sent += self.prefill.poll()
            arrived += self.decode.poll()
            time.sleep(0.002)
        return sent, arrived

    def restart_prefill(self, filled_kv_pool, posted_room: int) -> Pair:
        """Post `posted_room`, then restart the prefill side on the same address: a new
        instance that has never heard of this decode side. Returns the pair the new prefill
        side came from (close its decode side)."""
        self.decode.expect(self.target(posted_room), [1])
        self.run(lambda s, a: posted_room in self.prefill._posted)
        self.prefill.close()
        restarted = Pair(filled_kv_pool, 10.0, port=self.server.port)
        self.prefill, self.server = restarted.prefill, restarted.server
        return restarted

    def close_prefill(self, within: float) -> None:
        self.prefill_closed = True
        self.prefill.close(within)

    def close(self):
        self.decode.close()
        if not self.prefill_closed:
            self.prefill.close()


@pytest.fixture
def pair(filled_kv_pool):
    made = []

    def make(timeout: float = 10.0, **kwargs) -> Pair:
        made.append(Pair(filled_kv_pool, timeout, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def note(room, token=7):
    return RoomNote(
        room,
        RoomStatus.DONE,
        first_token=token,
        logprob=-0.5,
        top_logprobs=[(token, -0.5)],
        cached_tokens=3,
    )


def released(room):
    return lambda sent, arrived: any(o.room == room and o.released for o in arrived)


def test_a_room_moves_its_prompt_kv_and_first_token(pair):
    p = pair()
    src, dst = [3, 4, 5, 6, 20], [40, 41, 42, 7, 8]
    p.decode.expect(p.target(77), dst)
    p.prefill.open(77)
    p.prefill.prefilled(77, src, note(77, token=1234))
    sent, arrived = p.run(lambda s, a: s and a)
    assert [(o.room, o.ok) for o in sent] == [(77, True)] and sent[
        0
    ].nbytes == 5 * 2 * 2 * 2 * 8 * 2
    [outcome] = arrived
    assert (
        outcome.note.first_token == 1234
        and outcome.note.cached_tokens == 3
        and outcome.note.top_logprobs == [(1234, -0.5)]
    )
    for here, there in zip(p.prefill_pool.k + p.prefill_pool.v, p.decode_pool.k + p.decode_pool.v):
        assert torch.equal(there[dst], here[src])
    assert not p.prefill.busy(77) and not p.prefill.has_work() and not p.decode.has_rooms()


def test_rooms_pair_up_whatever_the_order_and_registration_happens_once(pair):
    p = pair()
    p.prefill.open(1)
    p.prefill.prefilled(1, [10, 11], note(1, 5))  # prefilled before the decode side asked
    p.decode.expect(p.target(1), [50, 51])
    p.decode.expect(p.target(2), [52])  # asked before the prefill side has the request
    p.run(lambda s, a: len(a) == 1)
    p.prefill.open(2)
    p.prefill.prefilled(2, [12], note(2, 6))
    sent, arrived = p.run(lambda s, a: len(a) == 1)
    assert arrived[0].note.first_token == 6
    assert len(p.prefill_agent.peers) == 1
    assert torch.equal(p.decode_pool.k[1][[50, 51, 52]], p.prefill_pool.k[1][[10, 11, 12]])


def test_a_decode_side_that_never_asks_times_the_prefill_side_out(pair):
    p = pair(timeout=0.3)
    p.prefill.open(8)
    p.prefill.prefilled(8, [1, 2], note(8))
    sent, _ = p.run(lambda s, a: s)
    assert [(o.room, o.reason) for o in sent] == [
        (8, FailureReason.TIMEOUT)
    ] and "within 0.3 s" in sent[0].error
    assert not p.prefill.has_work()


def test_a_post_that_came_in_time_wins_over_a_timeout_seen_in_the_same_turn(pair):
    """The prefill side's scheduler was held up past the timeout (a long step, a pause) while
    the decode side posted the room in time: its next turn sees both, and the room goes on (a
    prefill engine's 504 means that no decode engine asked for the room; the router blames
    the decode worker for it)."""
    p = pair(timeout=0.3, decode_timeout=10.0)
    p.decode.expect(p.target(7), [1])  # registers the decode side, which takes a prefill turn
    p.run(lambda s, a: 7 in p.prefill._posted)
    p.prefill.open(8)
    p.decode.expect(p.target(8), [4, 5])
    deadline = time.monotonic() + 0.6  # twice the timeout, the prefill side not turning
    while time.monotonic() < deadline:
        p.decode.poll()
        time.sleep(0.01)
    assert p.prefill.poll() == [] and p.prefill.posted(8)


def test_a_room_the_prefill_side_never_runs_times_out_and_is_released_once_it_confirms(pair):
    p = pair(timeout=0.3)
    p.decode.expect(p.target(9), [4])
    _, arrived = p.run(released(9))
    failure, release = arrived
    assert (failure.reason, failure.released) == (
        FailureReason.TIMEOUT,
        False,
    ) and "did not arrive" in failure.error
    assert (
        release.released and not p.decode.has_rooms()
    )  # the prefill side cancelled the room and said so


def test_a_decode_pool_of_another_shape_is_refused_with_the_reason(pair):
    p = pair(decode_kv_heads=4)
    p.decode.expect(p.target(5), [1])
    _, [outcome] = p.run(released(5))
    assert outcome.reason is FailureReason.REFUSED and "KV pools differ" in outcome.error


def test_a_decode_engine_the_prefill_side_cannot_reach_over_nixl_fails_its_rooms_at_once(
    pair, monkeypatch, caplog
):
    # Engines whose UCX transports share none (UCX_TLS, UCX_NET_DEVICES): NIXL cannot add
    # the decode engine's agent. Its rooms used to wait for the KV until the timeout.
    p = pair(timeout=30.0)
    attempts = []

    def unreachable(metadata, layout):
        attempts.append(layout.agent)
        raise TransferError("adding the peer's agent: nixlBackendError: NIXL_ERR_BACKEND")

    monkeypatch.setattr(p.prefill_agent, "connect", unreachable)
    started = time.monotonic()
    for room in (8, 9):  # each registers again, and is refused again
        p.prefill.open(room)
        p.prefill.prefilled(room, [1], note(room))
        p.decode.expect(p.target(room), [2])
        sent, [outcome] = p.run(lambda s, a, room=room: s and released(room)(s, a))
        assert outcome.reason is FailureReason.REFUSED and "NIXL_ERR_BACKEND" in outcome.error
        assert "cannot reach decode engine" in outcome.error
        assert [o.room for o in sent] == [room] and not sent[0].ok  # dropped on the prefill side
    assert time.monotonic() - started < 5
    assert caplog.text.count("cannot be reached over NIXL") == 1  # not once per request
    assert len(attempts) == 1  # the second registration is refused with the first's error


def test_an_unreachable_prefill_engine_fails_the_room_at_once_as_a_peer_lost(pair):
    # Lost, not refused: a prefill engine killed just before the room was posted is the same
    # failure as one killed just after, and is counted the same.
    p = pair()
    p.decode.expect(BootstrapTarget(6, "127.0.0.1", 1), [1])  # nothing listens on port 1
    _, [outcome] = p.run(released(6))
    assert outcome.reason is FailureReason.PEER_LOST and "ConnectError" in outcome.error
    assert "could not be reached" in outcome.error


def test_a_room_posted_twice_is_refused(pair):
    p = pair()
    p.decode.expect(p.target(3), [1])
    p.run(lambda s, a: p.server._rooms)
    answer = httpx.post(
        f"http://127.0.0.1:{p.server.port}/kv/rooms",
        json={"room": 3, "engine": "decode-test", "slots": [2]},
    )
    assert answer.status_code == 409 and "already in use" in answer.json()["error"]
    with pytest.raises(ValueError, match="already in use"):
        p.decode.expect(p.target(3), [2])


@pytest.mark.parametrize(
    "aborted, reason", [(False, FailureReason.REFUSED), (True, FailureReason.ABORTED)]
)
def test_a_cancel_before_the_write_reaches_the_prefill_side_and_releases_the_slots(
    pair, aborted, reason
):
    """The cancel says whether the decode side's request was aborted (its client left): the
    prefill side's request then fails as aborted, else as refused by the decode side."""
    p = pair()
    p.prefill.open(11)
    p.decode.expect(p.target(11), [1, 2])
    p.run(lambda s, a: p.prefill._rooms[11].target is not None)
    p.decode.cancel(11, "the client disconnected", aborted)
    sent, arrived = p.run(lambda s, a: s and a)
    assert [(o.room, o.reason) for o in sent] == [(11, reason)]
    assert "client disconnected" in sent[0].error
    assert [(o.room, o.released) for o in arrived] == [(11, True)]
    assert not p.prefill.has_work() and not p.decode.has_rooms()


def test_a_prefill_side_failure_reaches_the_decode_side_at_once(pair):
    p = pair()
    p.decode.expect(p.target(12), [1, 2])
    p.run(lambda s, a: 12 in p.prefill._posted)
    p.prefill.abandon(12, FailureReason.REFUSED, "the prompt is too long here", 400)
    _, [outcome] = p.run(lambda s, a: a)
    assert (outcome.reason, outcome.http_status, outcome.released) == (
        FailureReason.REFUSED,
        400,
        True,
    )
    assert "too long" in outcome.error


@pytest.mark.parametrize("first", ["refused", "queued"])
def test_a_refusal_of_a_room_the_decode_side_has_queued_reaches_it_before_any_post(
    pair, monkeypatch, first
):
    """The decode side has queued the room (its pool is full: no slots posted yet) when the
    prefill side refuses the room's request, before or after it hears that the decode side
    queued it: the refusal ends the queued room at once, not once its slots are posted, which
    may be long after the router gave up on the pair."""
    p = pair()
    heard = []  # what the prefill side's turns took from its bootstrap server
    drain = p.prefill.link.drain

    def drain_heard():
        facts = drain()
        heard.extend(facts)
        return facts

    monkeypatch.setattr(p.prefill.link, "drain", drain_heard)
    if first == "refused":
        p.prefill.abandon(13, FailureReason.REFUSED, "the prompt is too long here", 400)
    p.decode.queue(p.target(13))
    _, arrived = p.run(
        lambda s, a: any(isinstance(fact, RoomsQueued) and 13 in fact.rooms for fact in heard),
        timeout=5,
    )
    if first == "queued":
        p.prefill.abandon(13, FailureReason.REFUSED, "the prompt is too long here", 400)
    arrived += p.run(lambda s, a: arrived or a, timeout=5)[1]
    [outcome] = arrived
    assert (outcome.room, outcome.reason, outcome.http_status, outcome.released) == (
        13,
        FailureReason.REFUSED,
        400,
        True,
    )
    assert "too long" in outcome.error
    assert not p.decode.has_rooms()


def test_a_failed_write_fails_the_room_on_both_sides(pair, monkeypatch):
    p = pair()

    def broken(*args):
        raise RuntimeError("UCX says no")

    monkeypatch.setattr(p.prefill_agent, "write", broken)
    p.prefill.open(13)
    p.prefill.prefilled(13, [1], note(13))
    p.decode.expect(p.target(13), [2])
    sent, arrived = p.run(lambda s, a: s and any(o.released for o in a))
    assert sent[0].reason is FailureReason.TRANSFER and "UCX says no" in sent[0].error
    assert arrived[0].reason is FailureReason.TRANSFER and arrived[-1].released


def test_a_decode_engine_that_disconnected_fails_the_write_not_the_prefill_engine(
    pair, monkeypatch
):
    """NIXL raises exceptions of its own (not RuntimeError) when the peer is gone mid-write."""
    p = pair()
    remote_disconnect = type("nixlRemoteDisconnectError", (Exception,), {})

    def gone(handle):
        raise remote_disconnect("NIXL_ERR_REMOTE_DISCONNECT")

    monkeypatch.setattr(p.prefill_agent.agent, "transfer", gone)
    p.prefill.open(19)
    p.prefill.prefilled(19, [1], note(19))
    p.decode.expect(p.target(19), [2])
    sent, _ = p.run(lambda s, a: s)
    assert (
        sent[0].reason is FailureReason.TRANSFER and "NIXL_ERR_REMOTE_DISCONNECT" in sent[0].error
    )
    assert not p.prefill.busy(19)


def test_a_decode_engine_that_died_mid_write_costs_one_log_line_per_room(pair, monkeypatch, caplog):
    """Its write fails, and so does the note saying so: a warning, no traceback per room."""
    p = pair()
    remote_disconnect = type("nixlRemoteDisconnectError", (Exception,), {})

    def gone(*args):
        raise remote_disconnect("NIXL_ERR_REMOTE_DISCONNECT")

    monkeypatch.setattr(p.prefill_agent.agent, "transfer", gone)
    monkeypatch.setattr(p.prefill_agent.agent, "send_notif", gone)
    p.prefill.open(21)
    p.prefill.prefilled(21, [1], note(21))
    p.decode.expect(p.target(21), [2])
    sent, _ = p.run(lambda s, a: s)
    assert sent[0].reason is FailureReason.TRANSFER and not p.prefill.busy(21)
    [record] = [r for r in caplog.records if "room 21 ended failed" in r.getMessage()]
    assert record.exc_info is None and "NIXL_ERR_REMOTE_DISCONNECT" in record.getMessage()


class StalledWrite:
    """The prefill agent's writes stay in flight (NIXL says PROC, and the notes that come
    with them do not reach the decode side) until `end` is called; the notes the prefill
    side sends by themselves are recorded: a write slower than the timeout."""

    def __init__(self, p: Pair, monkeypatch):
        self.in_flight, self.error, self.notes = True, None, []
        real_done, real_notify = p.prefill_agent.done, p.prefill._notify
        real_notifications, held = p.decode_agent.notifications, []
        monkeypatch.setattr(p.prefill_agent, "done", self._done(real_done))

        def notifications():
            held.extend(real_notifications())
            if self.in_flight:
                return []
            arrived, held[:] = list(held), []
            return arrived

        monkeypatch.setattr(p.decode_agent, "notifications", notifications)

        def notify(engine, note):
            self.notes.append(note)
            real_notify(engine, note)

        monkeypatch.setattr(p.prefill, "_notify", notify)

    def _done(self, real_done):
        def done(transfer):
            if self.in_flight:
                return False
            if self.error is not None:
                raise TransferError(self.error)
            return real_done(transfer)

        return done

    def end(self, error: str | None = None) -> None:
        self.in_flight, self.error = False, error


def overdue_write(pair, monkeypatch, room: int) -> tuple[Pair, StalledWrite]:
    """A write past the prefill side's timeout: its request has failed, the write goes on.
    (The decode side waits longer: a slow start here must not let it cancel the room first.)"""
    p = pair(timeout=0.2, decode_timeout=30.0)
    stalled = StalledWrite(p, monkeypatch)
    p.prefill.open(room)
    p.prefill.prefilled(room, [1], note(room))
    p.decode.expect(p.target(room), [2])
    sent, _ = p.run(lambda s, a: s)
    assert [(o.room, o.reason) for o in sent] == [(room, FailureReason.TRANSFER)]
    assert "did not finish within 0.2 s" in sent[0].error
    later = time.monotonic() + 0.5
    while time.monotonic() < later:
        assert p.prefill.poll() == []
        time.sleep(0.01)
    # releasing a NIXL handle does not stop its puts: the room's last word (which lets the
    # decode side reuse the slots) and the source slots wait for the write's end
    assert p.prefill.busy(room) and stalled.notes == []
    return p, stalled


def test_an_overdue_write_holds_the_room_until_it_is_done_and_its_own_note_ends_it(
    pair, monkeypatch
):
    p, stalled = overdue_write(pair, monkeypatch, room=32)
    stalled.end()
    p.run(lambda s, a: not p.prefill.busy(32))
    assert stalled.notes == []  # NIXL's note with the KV was the last word


def test_an_overdue_write_that_fails_sends_the_failure_as_the_last_word(pair, monkeypatch):
    p, stalled = overdue_write(pair, monkeypatch, room=33)
    stalled.end(error="the KV write failed (ERR)")
    sent, _ = p.run(lambda s, a: not p.prefill.busy(33))
    assert sent == []  # the request failed once already
    [last_word] = stalled.notes
    assert last_word.status is RoomStatus.FAILED and "ERR" in last_word.error


def test_a_cancel_keeps_the_slots_while_the_write_runs_and_frees_them_when_it_ends(
    pair, monkeypatch
):
    """The decode side gives up on a room whose write is overdue and cancels it: the prefill
    side answers that the write is still in flight, so the slots stay held past the bound
    for a lost last word (twice the timeout), and come back once the write has ended."""
    p, stalled = overdue_write(pair, monkeypatch, room=34)
    cancel = f"http://127.0.0.1:{p.server.port}/kv/rooms/34"
    answer = httpx.request("DELETE", cancel, json={"reason": "test"})
    assert (answer.status_code, answer.json()) == (200, {"write_in_flight": True})
    p.decode.cancel(34, "the client disconnected")
    later = time.monotonic() + 4 * 0.2 + 0.3  # past twice the timeout, and two heartbeats
    while time.monotonic() < later:
        assert p.prefill.poll() == [] and not any(o.released for o in p.decode.poll())
        time.sleep(0.01)
    assert p.decode.has_rooms() and p.prefill.busy(34)
    stalled.end()
    p.run(released(34))


def started_write(pair, monkeypatch, room: int) -> tuple[Pair, StalledWrite]:
    p = pair(timeout=30.0)
    stalled = StalledWrite(p, monkeypatch)
    p.prefill.open(room)
    p.prefill.prefilled(room, [1], note(room))
    p.decode.expect(p.target(room), [2])
    p.run(lambda s, a: p.prefill.busy(room))
    return p, stalled


def closing(p: Pair, within: float) -> threading.Thread:
    thread = threading.Thread(target=p.close_prefill, args=(within,))
    thread.start()
    time.sleep(0.3)
    return thread


def bootstrap_server_answers(p: Pair) -> bool:
    return httpx.get(f"http://127.0.0.1:{p.server.port}/health").status_code == 200


def test_closing_the_prefill_side_waits_for_its_write_in_flight(pair, monkeypatch):
    """At shutdown the bootstrap server keeps answering until the write has ended: the
    decode side would free its slots as soon as it stopped, with the write still landing."""
    p, stalled = started_write(pair, monkeypatch, room=41)
    thread = closing(p, within=30.0)
    assert thread.is_alive() and bootstrap_server_answers(p)
    stalled.end()
    thread.join(timeout=5.0)
    assert not thread.is_alive()
    arrived: list = []
    deadline = time.monotonic() + 5.0
    while not arrived:
        assert time.monotonic() < deadline
        arrived += p.decode.poll()
    assert [(o.room, o.error) for o in arrived] == [(41, None)]


def test_closing_gives_up_on_a_write_that_does_not_end_within_the_wait(pair, monkeypatch, caplog):
    p, _ = started_write(pair, monkeypatch, room=42)
    started = time.monotonic()
    p.close_prefill(within=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert "1 KV writes still in flight after 0.3 s" in caplog.text


class OtherRankWriting(RankConsensus):
    """Rank 0 of two, with rank 1's turns made up: rank 1 still writes until `end`."""

    def __init__(self):
        super().__init__()
        self.other_writes = 1

    def share(self, local):
        return local + [
            dataclasses.replace(fact, rank=1, writes=self.other_writes, expired=False)
            for fact in local
            if isinstance(fact, ClosingTurn)
        ]


def test_closing_waits_for_the_writes_of_every_rank(pair):
    """Rank 0 alone keeps the bootstrap server: with no write of its own left, it still
    waits for the other ranks' writes into the same rooms."""
    p = pair()
    p.prefill.consensus = other = OtherRankWriting()
    thread = closing(p, within=30.0)
    assert thread.is_alive() and bootstrap_server_answers(p)
    other.other_writes = 0
    thread.join(timeout=5.0)
    assert not thread.is_alive()


class ThreadRank(RankConsensus):
    """One of two ranks on threads of this process: `share` gathers through a barrier, as
    all_gather_object does across processes (a rank left waiting breaks it: no hang)."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier):
        super().__init__(rank, 2, group=object())  # type: ignore[arg-type] - never used
        self.slots, self.barrier, self.calls = slots, barrier, 0

    def share(self, local):
        self.slots[self.rank] = local
        self.barrier.wait()
        gathered = [fact for part in self.slots for fact in part]
        self.barrier.wait()  # every rank has read before the next round writes
        self.calls += 1
        return gathered


@pytest.mark.parametrize("write_ends", [True, False])
def test_ranks_stop_waiting_together_on_rank_0s_clock(filled_kv_pool, write_ends):
    """Rank 1 alone has a write in flight and its own wait is short: both ranks wait for that
    write, or stop together when rank 0's wait is over, calling the collective as often."""
    slots: list = [None, None]
    barrier = threading.Barrier(2, timeout=10.0)
    pools = filled_kv_pool(1), filled_kv_pool(2)
    ranks = [
        PrefillTransfers(
            KVTransferAgent(pools[rank]),
            ThreadRank(rank, slots, barrier),
            LocalLink() if rank == 0 else None,
            10.0,
            "127.0.0.1",
            0,
        )
        for rank in (0, 1)
    ]
    write_ends_at = time.monotonic() + 0.5
    ranks[1]._writes = {9: object()}  # type: ignore[dict-item] - only counted while closing

    def rank_1_writes():
        if write_ends and time.monotonic() > write_ends_at:
            ranks[1]._writes.clear()
        return []

    ranks[1]._ended_writes = rank_1_writes  # type: ignore[method-assign]
    waits = {0: 30.0 if write_ends else 0.3, 1: 0.05}
    ended: dict[int, float] = {}

    def close(rank: int) -> None:
        ranks[rank].close(waits[rank])
        ended[rank] = time.monotonic()

    started = time.monotonic()
    threads = [threading.Thread(target=close, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15.0)
    assert sorted(ended) == [0, 1] and not barrier.broken
    assert ranks[0].consensus.calls == ranks[1].consensus.calls > 1
    assert min(ended.values()) - started >= (0.5 if write_ends else 0.3)


def test_a_cancel_that_meets_no_write_is_confirmed_once_the_prefill_side_took_it(pair):
    """A write may start between a cancel's answer and the scheduler taking the cancel, so
    the first answer for a posted room says a write may be in flight; once the scheduler has
    taken the cancel (no write started), the answer says none runs."""
    p = pair()
    p.decode.expect(p.target(35), [1])
    p.run(lambda s, a: 35 in p.prefill._posted)
    cancel = f"http://127.0.0.1:{p.server.port}/kv/rooms/35"
    answer = httpx.request("DELETE", cancel, json={"reason": "test"})
    assert (answer.status_code, answer.json()) == (200, {"write_in_flight": True})
    p.prefill.poll()  # takes the cancel: the room's request has not come, none will run
    answer = httpx.request("DELETE", cancel, json={"reason": "test"})
    assert (answer.status_code, answer.json()) == (200, {"write_in_flight": False})


def test_a_cancel_asked_again_reaches_the_prefill_scheduler_once(pair):
    """The decode side asks again while a write may be in flight (every heartbeat): the
    scheduler hears of the cancel once, not once per asking."""
    p = pair()
    p.decode.expect(p.target(36), [1])
    p.run(lambda s, a: 36 in p.prefill._posted)
    emitted = []
    emit = p.server.emit

    def recording_emit(fact) -> None:
        emitted.append(fact)
        emit(fact)

    p.server.emit = recording_emit
    cancel = f"http://127.0.0.1:{p.server.port}/kv/rooms/36"
    for _ in range(3):
        answer = httpx.request("DELETE", cancel, json={"reason": "test"})
        assert (answer.status_code, answer.json()) == (200, {"write_in_flight": True})
    assert [type(fact).__name__ for fact in emitted] == ["RoomCancelled"]


def test_a_dead_prefill_engine_fails_its_rooms_within_the_heartbeat_window(pair):
    p = pair(dead_after_s=0.5)
    p.decode.expect(p.target(14), [1])
    p.run(lambda s, a: 14 in p.prefill._posted)
    p.server.close()  # the prefill engine is gone
    started = time.monotonic()
    _, arrived = p.run(released(14))
    assert arrived[0].reason is FailureReason.PEER_LOST and "is gone" in arrived[0].error
    assert time.monotonic() - started < 5


def test_a_room_cancelled_at_a_dead_prefill_engine_is_released_by_the_cancel(pair):
    """The request went away as its prefill engine died: the cancel finds nothing listening
    there, so no write can come, and the slots go without waiting for a heartbeat."""
    p = pair()
    p.decode.expect(p.target(16), [1])
    p.run(lambda s, a: 16 in p.prefill._posted)
    p.client.heartbeat_s = 30  # no heartbeat from now on
    time.sleep(0.15)
    p.server.close()  # the prefill engine is gone
    p.decode.cancel(16, "the client went away")
    _, arrived = p.run(released(16), timeout=5.0)
    assert arrived[-1].reason is None  # the request had ended already: no second error


def unreachable(client, path: str) -> None:
    """Every call of the decode side's client to `path` fails to connect, the connection not
    refused: no route to the prefill engine, which may still be alive and writing."""
    http = client._http
    real = http.request

    def request(method, url, *args, **kwargs):
        if str(url).endswith(path):
            raise httpx.ConnectError("[Errno 113] No route to host")
        return real(method, url, *args, **kwargs)

    http.request = request


def test_an_unreachable_prefill_engine_is_dead_only_after_its_silence(pair):
    """Only a refused connection proves that nothing writes from there: a prefill engine that
    cannot be reached otherwise has until `dead_after_s` to answer again."""
    p = pair(dead_after_s=0.6)
    p.decode.expect(p.target(18), [1])
    p.run(lambda s, a: 18 in p.prefill._posted)
    unreachable(p.client, "/health")
    started = time.monotonic()
    _, arrived = p.run(released(18))
    assert arrived[0].reason is FailureReason.PEER_LOST
    assert "has not answered for" in arrived[0].error
    assert time.monotonic() - started >= 0.5


def test_a_cancel_that_cannot_reach_the_prefill_engine_keeps_the_slots(pair):
    """A cancel that finds no route to the prefill engine cannot tell whether a write comes:
    the slots stay until the engine answers or the heartbeat finds it dead."""
    p = pair()
    p.decode.expect(p.target(19), [1])
    p.run(lambda s, a: 19 in p.prefill._posted)
    client = p.client
    client.heartbeat_s = 30  # no heartbeat from now on
    time.sleep(0.15)
    unreachable(client, "/kv/rooms/19")
    p.decode.cancel(19, "the client went away")
    time.sleep(0.5)
    assert not any(o.released for o in p.decode.poll())


def test_a_refusal_for_a_dead_prefill_engine_is_not_retried_at_every_heartbeat(pair, caplog):
    """A request refused here before its room was posted (the client went away as its prefill
    engine died): nothing listens there, so nothing is left to cancel."""
    p = pair()
    p.decode.expect(p.target(15), [1])  # registers this decode engine there
    p.run(lambda s, a: 15 in p.prefill._posted)
    p.server.close()
    p.decode.refuse(p.target(17), "the client went away")
    time.sleep(0.6)  # six heartbeats
    assert caplog.text.count("cancelling room 17") == 0


def test_a_restarted_prefill_engine_is_registered_with_again(pair, filled_kv_pool):
    p = pair()
    restarted = p.restart_prefill(filled_kv_pool, posted_room=15)
    port = p.server.port
    try:
        p.decode.expect(p.target(16), [2, 3])
        p.prefill.open(16)
        p.prefill.prefilled(16, [5, 6], note(16, 9))
        _, arrived = p.run(
            lambda s, a: any(o.room == 16 and o.note for o in a) and any(o.room == 15 for o in a)
        )
        by_room = {o.room: o for o in arrived}
        assert by_room[16].note.first_token == 9
        # gone while it was down, or restarted once it was back: its rooms are lost either way
        assert (
            by_room[15].reason is FailureReason.PEER_LOST
            and f"127.0.0.1:{port}" in by_room[15].error
        )
    finally:
        restarted.decode.close()


def test_a_prefill_engine_that_stops_answering_fails_its_rooms_after_the_silence_allowed(pair):
    p = pair(dead_after_s=1.0)
    p.decode.expect(p.target(17), [1])
    p.run(lambda s, a: 17 in p.prefill._posted)
    p.server._http.shutdown()  # still listening, never answering: hung, not gone
    started = time.monotonic()
    _, arrived = p.run(released(17))
    assert arrived[0].reason is FailureReason.PEER_LOST and "has not answered" in arrived[0].error
    assert (
        0.5 < time.monotonic() - started < 8
    )  # the silence counts from the last answer, just before


def test_a_decode_engine_of_another_tensor_parallel_size_is_refused_with_the_reason(pair):
    p = pair()
    mine = RankAgent(p.decode_agent.metadata, p.decode_agent.layout)
    p.decode.link.close()  # the same agent, announced as the two ranks of one engine
    p.decode = DecodeTransfers(
        p.decode_agent,
        RankConsensus(),
        LocalLink(),
        10.0,
        ConnectBootstrap("decode-tp2", (mine, mine)),
    )
    p.decode.expect(p.target(18), [1])
    _, [outcome] = p.run(released(18))
    assert outcome.reason is FailureReason.REFUSED and "tensor-parallel size 2" in outcome.error


# -- failures found by a review (ninth session): each test failed before its fix ----------------


def test_first_posts_to_a_new_prefill_engine_arrive_while_every_worker_thread_waits(pair):
    """A burst of rooms posted at once to a prefill engine not registered with yet: each post
    waits for the registration, which waited for a worker thread that no post would free (a
    deadlock for good). Here all threads but one are kept busy and the last post is the first."""
    p = pair()
    client, address = p.client, p.target(0).address
    busy = threading.Event()
    for i in range(15):  # of 16, at most 4 per address
        client._workers.submit(f"http://busy-{i % 4}:1", busy.wait, 10)
    try:
        client.post(PostRoom(100, address, (0,)))
        p.run(lambda s, a: 100 in p.prefill._posted, timeout=5)
    finally:
        busy.set()


def test_a_prefill_engine_that_never_answers_does_not_delay_posts_to_the_others(pair):
    """One pool of eight threads served every prefill engine, and a cancel held a thread
    while its post waited: an engine whose connections are never accepted (each post then
    waits for its read timeout) took every thread, and posts to the others waited with it."""
    p = pair()
    client = p.client
    client._http.timeout = httpx.Timeout(2.0)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # connections complete in the backlog, and nothing reads them
        hung_port = hung.getsockname()[1]
        for room in range(200, 216):
            p.decode.expect(BootstrapTarget(room, "127.0.0.1", hung_port), [room - 200])
            p.decode.cancel(room, "the client went away")
        p.decode.expect(p.target(220), [20])
        p.run(lambda s, a: 220 in p.prefill._posted, timeout=1.0)


def test_hung_prefill_engines_do_not_make_a_heartbeat_round_last_a_timeout_each():
    """The heartbeat checked the prefill engines one after another: each hung one (its /health
    answered only at the check's timeout) delayed the checks of the rest by that much, and
    their dead engines' rooms failed that much later. They are checked all at once."""
    hung = [f"http://10.0.0.{i}:8998" for i in range(1, 6)]
    started: dict[str, float] = {}

    class _Hung:
        def get(self, url: str, timeout: float) -> httpx.Response:
            started.setdefault(url.removesuffix("/health"), time.monotonic())
            time.sleep(timeout)
            raise httpx.ReadTimeout("timed out")

        def close(self) -> None:
            pass

    connect = ConnectBootstrap("decode-test", (), heartbeat_s=0.2, dead_after_s=60.0)
    client = BootstrapClient(lambda fact: None, connect)
    client._http.close()
    client._http = _Hung()  # type: ignore[assignment]
    with client._lock:
        for address in hung:
            client._peers[address] = bootstrap_client._Peer(rooms={1: "instance"})
    try:
        deadline = time.monotonic() + 5.0
        while len(started) < len(hung) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()
    assert len(started) == len(hung)
    # one after another, the last began four timeouts (0.8 s) after the first
    assert max(started.values()) - min(started.values()) < 0.2


def test_a_heartbeat_check_that_fails_is_logged_once_with_its_address(caplog):
    """The checks run on worker threads whose futures nobody else reads: an exception there
    (here the scheduler's end of a restart's news) vanished without a word."""
    address = "http://10.0.0.1:8998"

    class _Restarted:
        def get(self, url: str, timeout: float) -> httpx.Response:
            return httpx.Response(200, json={"instance": "new"}, request=httpx.Request("GET", url))

        def close(self) -> None:
            pass

    def emit(fact) -> None:
        raise RuntimeError("the scheduler's queue is gone")

    connect = ConnectBootstrap("decode-test", (), heartbeat_s=0.05, dead_after_s=60.0)
    client = BootstrapClient(emit, connect)
    client._http.close()
    client._http = _Restarted()  # type: ignore[assignment]
    with client._lock:
        client._peers[address] = bootstrap_client._Peer(rooms={1: "old"})
    try:
        deadline = time.monotonic() + 5.0
        while "heartbeat check" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # six heartbeats more: the room is gone, nothing else to check
    finally:
        client.close()
    [record] = [r for r in caplog.records if "heartbeat check" in r.getMessage()]
    assert record.levelname == "ERROR" and address in record.getMessage()
    assert record.exc_info is not None and "queue is gone" in str(record.exc_info[1])


def test_a_heartbeat_check_failing_beat_after_beat_is_logged_once_until_one_passes(caplog):
    """A check that keeps failing (here its question of the rooms ended) would write an
    ERROR and its traceback every heartbeat: once, until a check of that engine passes."""
    address = "http://10.0.0.1:8998"
    failing = threading.Event()
    failing.set()

    class _Alive:
        def get(self, url: str, timeout: float) -> httpx.Response:
            return httpx.Response(200, json={"instance": "old"}, request=httpx.Request("GET", url))

        def close(self) -> None:
            pass

    connect = ConnectBootstrap("decode-test", (), heartbeat_s=0.02, dead_after_s=60.0)
    client = BootstrapClient(lambda fact: None, connect)
    client._http.close()
    client._http = _Alive()  # type: ignore[assignment]
    checks = []

    def ask_ended(address: str, peer) -> None:
        checks.append(address)
        if failing.is_set():
            raise RuntimeError("a bug of ours")

    client._ask_ended = ask_ended  # type: ignore[method-assign]
    with client._lock:
        client._peers[address] = bootstrap_client._Peer(rooms={1: "old"})

    def errors() -> int:
        return sum(
            r.levelname == "ERROR" and "heartbeat check" in r.getMessage() for r in caplog.records
        )

    def beats(count: int) -> None:
        deadline, start = time.monotonic() + 5.0, len(checks)
        while len(checks) < start + count and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        beats(10)
        assert errors() == 1
        failing.clear()
        beats(3)
        failing.set()
        beats(3)
    finally:
        client.close()
    assert errors() == 2  # failing again after a pass: said again


def test_a_post_whose_answer_is_lost_holds_the_slots_until_the_prefill_side_says(pair):
    """The prefill engine took the room but its answer came too late: the decode side fails
    the request, yet may reuse the room's slots only once no write can come (here: its
    cancel reached the prefill engine, which drops the room)."""
    p = pair(timeout=5.0)
    client = p.client
    client._http.timeout = httpx.Timeout(0.5)
    original = p.server.post_room

    def slow(post):
        answer = original(post)  # the room is taken...
        time.sleep(1.0)  # ...but the answer is late
        return answer

    p.server.post_room = slow
    p.decode.expect(p.target(21), [40, 41])
    _, arrived = p.run(released(21))
    failed = [o for o in arrived if o.error is not None]
    assert failed and not failed[0].released, arrived
    assert 21 not in p.prefill._posted  # released only once the prefill side dropped the room


def test_one_late_heartbeat_after_an_idle_spell_does_not_declare_a_peer_dead(pair):
    p = pair(dead_after_s=1.0)
    p.decode.expect(p.target(31), [1])
    p.run(lambda s, a: 31 in p.prefill._posted)
    p.prefill.abandon(31, FailureReason.REFUSED, "no")
    p.run(released(31))
    time.sleep(1.5)  # no rooms at that prefill engine: no heartbeat either
    original, calls = p.server.health, []

    def slow_once():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)  # later than the heartbeat's timeout (0.1 s here)
        return original()

    p.server.health = slow_once
    p.decode.expect(p.target(32), [2])
    p.run(lambda s, a: len(calls) >= 3 or a, timeout=5)
    assert p.decode.waiting(32)


def test_concurrent_posts_after_a_restart_keep_the_rooms_the_new_instance_took(
    pair, filled_kv_pool
):
    p = pair()
    p.client.heartbeat_s = 30  # a restart between two heartbeats
    restarted = p.restart_prefill(filled_kv_pool, posted_room=50)
    try:
        rooms = set(range(51, 57))
        for i, room in enumerate(sorted(rooms)):  # a burst right after the restart
            p.decode.expect(p.target(room), [10 + i])
        _, arrived = p.run(lambda s, a: rooms <= set(p.prefill._posted) or a, timeout=8)
        time.sleep(0.3)
        arrived += p.decode.poll()
        lost = {o.room for o in arrived if o.reason is FailureReason.PEER_LOST}
        assert not (lost & set(p.prefill._posted)), (lost, sorted(p.prefill._posted))
        assert lost <= {50}  # the room posted at the instance that went
    finally:
        restarted.decode.close()


def test_a_malformed_notification_is_dropped(pair):
    p = pair()
    p.decode.expect(p.target(60), [1])
    p.run(lambda s, a: 60 in p.prefill._posted)  # the prefill agent knows the decode agent now
    p.prefill_agent.notify(p.decode_agent.name, b"not json")
    done_without_token = RoomNote(60, RoomStatus.DONE).encode()
    p.prefill_agent.notify(p.decode_agent.name, done_without_token)
    time.sleep(0.2)
    for _ in range(20):
        assert not [o for o in p.decode.poll() if o.note is not None]
        time.sleep(0.01)
    assert p.decode.waiting(60)


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("DELETE", "/kv/rooms/5", [1, 2], 400),  # a body that is no JSON object
        ("DELETE", "/kv/rooms/5", {"reason": "gone", "aborted": "yes"}, 400),
        ("POST", "/kv/rooms", {"room": -3.7, "engine": "decode-test", "slots": [1]}, 400),
        ("POST", "/kv/rooms", {"room": 2**63, "engine": "decode-test", "slots": [1]}, 400),
        ("POST", "/kv/rooms", {"room": 9, "engine": "decode-test", "slots": [-5, True]}, 400),
        ("POST", "/kv/rooms", {"room": 9, "engine": "decode-test", "slots": [10**9]}, 400),
        ("POST", "/kv/rooms/queued", {"engine": "nobody", "rooms": [1]}, 404),
    ],
)
def test_the_bootstrap_server_refuses_malformed_requests(pair, method, path, body, status):
    p = pair()
    p.decode.expect(p.target(70), [1])  # decode-test registers
    p.run(lambda s, a: 70 in p.prefill._posted)
    answer = httpx.request(method, f"http://127.0.0.1:{p.server.port}{path}", json=body)
    assert answer.status_code == status, answer.text
    assert httpx.get(f"http://127.0.0.1:{p.server.port}/health").status_code == 200


# -- a prefill engine's last word that never comes ------------------------------------------


def test_a_room_whose_last_word_is_lost_is_released_once_no_write_can_come(pair, monkeypatch):
    """The client left; the decode side cancelled the room and the prefill side confirmed,
    but its note (its last word) was lost: the slots were held for as long as the prefill
    engine lived. They are released once the prefill side's own timeout has passed twice
    since it confirmed: by then a write in flight has ended, unless it is stuck."""
    p = pair(timeout=0.3)
    monkeypatch.setattr(p.prefill, "_notify", lambda engine, note: None)  # every note lost
    p.prefill.open(80)
    p.decode.expect(p.target(80), [1, 2])
    p.run(lambda s, a: p.prefill._rooms[80].target is not None)
    p.decode.cancel(80, "the client disconnected")
    confirmed = time.monotonic()
    _, arrived = p.run(released(80), timeout=5)
    assert time.monotonic() - confirmed >= 2 * 0.3
    assert [(o.room, o.error) for o in arrived] == [(80, None)] and not p.decode.has_rooms()


def test_a_room_waiting_for_a_note_that_is_lost_times_out_and_is_released(pair, monkeypatch):
    """The write's DONE note is lost: the room times out (504 for its request), is cancelled
    at the prefill side, and its slots come back once no write can come."""
    p = pair(timeout=0.3)
    monkeypatch.setattr(p.prefill, "_notify", lambda engine, note: None)
    p.decode.expect(p.target(81), [1])
    _, arrived = p.run(released(81), timeout=5)
    assert arrived[0].reason is FailureReason.TIMEOUT and arrived[-1].released


# -- decode engines that went away ----------------------------------------------------------


def test_a_decode_engine_not_heard_from_is_forgotten_and_registers_again_when_back(pair):
    """Decode pods come and go (autoscaling, restarts): a prefill engine kept each one's
    registration and NIXL connection for as long as it lived. One it has not heard from for
    the idle limit, with no room here, is forgotten; if it was only idle, its next post
    registers it again and the room runs."""
    p = pair()
    p.decode.expect(p.target(90), [1])
    p.prefill.open(90)
    p.prefill.prefilled(90, [2], note(90))
    p.run(lambda s, a: s and a)
    assert p.prefill._peer_agents and p.prefill_agent.peers
    time.sleep(0.5)
    p.server.forget_idle_peers(idle_s=0.3)  # as every request to the bootstrap server does
    p.run(lambda s, a: not p.prefill._peer_agents, timeout=5)
    assert not p.prefill_agent.peers and not p.server._engines
    p.decode.expect(p.target(91), [3])
    p.prefill.open(91)
    p.prefill.prefilled(91, [4], note(91, 8))
    _, arrived = p.run(lambda s, a: a)
    assert [(o.room, o.note.first_token if o.note else o.error) for o in arrived] == [(91, 8)]


def test_a_forgotten_decode_engine_with_a_room_here_keeps_its_connection_and_its_room(pair):
    """Forgotten while one of its rooms waits here for its prompt: the connection stays (the
    write still goes there), and the decode side, told `unknown_peer` on its next post by the
    same instance, registers again without giving up the rooms it has here."""
    p = pair()
    p.decode.expect(p.target(92), [1])
    p.run(lambda s, a: 92 in p.prefill._posted)
    time.sleep(0.5)
    p.server.forget_idle_peers(idle_s=0.3)
    p.run(lambda s, a: not p.server._engines, timeout=5)
    p.decode.expect(p.target(93), [2])
    p.run(lambda s, a: 93 in p.prefill._posted, timeout=5)
    for room, slot in ((92, 5), (93, 6)):
        p.prefill.open(room)
        p.prefill.prefilled(room, [slot], note(room, room))
    _, arrived = p.run(lambda s, a: len(a) == 2)
    assert sorted((o.room, o.note.first_token) for o in arrived if o.note) == [(92, 92), (93, 93)]


def test_a_room_the_prefill_side_has_already_is_a_conflict_for_the_request(pair):
    """A room number P already has (a client that reuses its bootstrap_room): the request
    fails as a 409, as a room in use on D does, not as a 502."""
    p = pair()
    p.decode.expect(p.target(94), [1])
    p.run(lambda s, a: 94 in p.prefill._posted)
    p.decode._rooms.pop(94)
    p.decode.expect(p.target(94), [2])
    _, [outcome] = p.run(released(94))
    assert (outcome.reason, outcome.http_status) == (FailureReason.REFUSED, 409), outcome
    assert "already in use" in outcome.error
    time.sleep(0.3)  # a cancel of the room, were one sent, would have arrived
    p.prefill.poll()
    assert 94 in p.prefill._posted and p.prefill.closed(94) is None  # its owner's room is intact


def test_a_prefill_engine_that_does_not_say_its_timeout_is_still_registered_with(pair):
    """An engine from before the registration answer named its timeout (a rolling upgrade
    pairs old and new pods): its rooms work; a confirmed cancel waits for its last word."""
    p = pair()
    original = p.server.register

    def old_register(registration):
        status, answer = original(registration)
        return status, {"instance": answer["instance"]}

    p.server.register = old_register
    p.decode.expect(p.target(96), [1])
    p.prefill.open(96)
    p.prefill.prefilled(96, [2], note(96, 4))
    _, arrived = p.run(lambda s, a: a)
    assert [o.note.first_token for o in arrived if o.note] == [4]


def test_a_failed_registration_again_keeps_the_rooms_at_the_same_instance(pair):
    """The prefill engine forgot this engine; registering again fails once (a timeout, a
    5xx): the rooms already there stay watched at the instance they are at, not failed as
    a silent engine's (their slots would come back while its writes may still land)."""
    p = pair(dead_after_s=0.5)
    p.decode.expect(p.target(97), [1])
    p.run(lambda s, a: 97 in p.prefill._posted)
    p.server.forget_idle_peers(idle_s=0)
    original, calls = p.server.register, []

    def failing_once(registration):
        calls.append(1)
        return (500, {"error": "not now"}) if len(calls) == 1 else original(registration)

    p.server.register = failing_once
    p.decode.expect(p.target(98), [2])
    _, arrived = p.run(released(98))
    assert arrived[0].error and "not now" in arrived[0].error
    time.sleep(1.5)  # three silences allowed
    assert not [o for o in p.decode.poll() if o.room == 97] and p.decode.waiting(97)
    p.prefill.open(97)
    p.prefill.prefilled(97, [3], note(97, 5))
    _, arrived = p.run(lambda s, a: a)
    assert [(o.room, o.note.first_token) for o in arrived if o.note] == [(97, 5)]


def test_rooms_queued_after_being_forgotten_register_again_and_keep_waiting(pair):
    p = pair()
    p.decode.expect(p.target(99), [1])  # registers
    p.run(lambda s, a: 99 in p.prefill._posted)
    p.server.forget_idle_peers(idle_s=0)
    p.client.still_queued(StillQueued(p.target(0).address, (100,)))
    p.run(lambda s, a: 100 in p.prefill._queued, timeout=5)


def test_a_restart_fails_only_the_rooms_at_the_instance_that_went():
    """A post sent under the registration with the old instance may reach the new one (it
    restarted in between, and this engine registered again): that room is at the new
    instance, and fails with the old one's rooms no more (CI caught a burst losing it)."""
    from kubesgl.engine.disagg.bootstrap_client import _Peer

    emitted: list = []
    client = BootstrapClient(emitted.append, ConnectBootstrap("decode-test", ()))
    try:
        peer = _Peer(rooms={50: "old", 56: "new"})
        client._restarted("http://p:1", peer, "new")
        assert [(type(f).__name__, f.rooms) for f in emitted] == [("PeerLost", (50,))]
        assert peer.rooms == {56: "new"}
    finally:
        client.close()


def test_the_bootstrap_process_logs_no_line_per_heartbeat(caplog):
    import logging

    from kubesgl.engine.disagg.bootstrap import quiet_request_logs

    httpx_logger = logging.getLogger("httpx")
    level = httpx_logger.level
    try:
        caplog.set_level(logging.INFO)
        quiet_request_logs()
        httpx_logger.info("HTTP Request: GET http://p:8998/health")
        assert "HTTP Request" not in caplog.text
    finally:
        httpx_logger.setLevel(level)


def test_a_refusal_is_found_behind_the_exceptions_that_carry_it():
    """httpx wraps the OSError; an async connect to a name of several addresses raises a
    group, refused only if every address refused."""
    from kubesgl.engine.disagg.bootstrap_client import _nothing_listens

    def wrapped(cause: BaseException) -> httpx.ConnectError:
        try:
            raise httpx.ConnectError("connect failed") from cause
        except httpx.ConnectError as exc:
            return exc

    refused = ConnectionRefusedError(111, "Connection refused")
    unreachable = OSError(113, "No route to host")
    assert _nothing_listens(wrapped(refused))
    assert not _nothing_listens(wrapped(unreachable))
    assert _nothing_listens(wrapped(ExceptionGroup("all", [refused, refused])))
    assert not _nothing_listens(wrapped(ExceptionGroup("some", [refused, unreachable])))


def test_overlapping_registrations_of_one_decode_engine_both_take_the_connect_outcome(pair):
    # The second used to take the first's place: the first then waited out CONNECT_WAIT_S and
    # was answered 200 though the connect had failed.
    p = pair()
    twice = PeerRegistration(
        "decode-twice", (RankAgent(p.decode_agent.metadata, p.decode_agent.layout),)
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(p.server.register, twice) for _ in range(2)]
        deadline = time.monotonic() + 5
        while sum(len(w) for w in p.server._connecting.values()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        p.server.peer_connected(PeerConnected("decode-twice", "no UCX transport in common"))
        statuses = [answer.result()[0] for answer in answers]
    assert statuses == [502, 502] and time.monotonic() - started < 1


# -- notes NIXL does not deliver, and decode engines NIXL cannot reach: each failed before ----


def notes_held(p: Pair, monkeypatch) -> list[bytes]:
    """Every NIXL notification to the decode side is held back (a firewall after the
    handshake, a note lost); the list returned holds them, and `p.release_notes()` lets
    them through. The KV writes themselves land."""
    held: list[bytes] = []
    real = p.decode_agent.notifications
    released = threading.Event()

    def notifications():
        held.extend(real())
        if not released.is_set():
            return []
        arrived, held[:] = list(held), []
        return arrived

    monkeypatch.setattr(p.decode_agent, "notifications", notifications)
    p.release_notes = released.set  # type: ignore[attr-defined]
    return held


def test_a_room_written_whose_note_is_lost_fails_soon_with_the_reason(pair, monkeypatch):
    """The KV write is done but its note (the first token) never reaches the decode side: it
    waited its whole timeout (504). The prefill side reports the room's end to the decode
    side's heartbeat, and the room fails after a short grace, as a transfer failure."""
    p = pair(timeout=30.0)
    notes_held(p, monkeypatch)
    p.prefill.open(120)
    p.prefill.prefilled(120, [1], note(120))
    started = time.monotonic()
    p.decode.expect(p.target(120), [2])
    sent, arrived = p.run(lambda s, a: s and a, timeout=10)
    assert [o.ok for o in sent] == [True]
    [outcome] = arrived
    assert (outcome.reason, outcome.released) == (FailureReason.TRANSFER, True), outcome
    assert "wrote the KV" in outcome.error and "did not arrive" in outcome.error
    assert time.monotonic() - started < 5 and not p.decode.has_rooms()


def test_a_refusal_whose_note_is_lost_reaches_the_decode_side_with_its_status(pair, monkeypatch):
    p = pair(timeout=30.0)
    notes_held(p, monkeypatch)
    p.decode.expect(p.target(121), [1, 2])
    p.run(lambda s, a: 121 in p.prefill._posted)
    p.prefill.abandon(121, FailureReason.REFUSED, "the prompt is too long here", 400)
    _, [outcome] = p.run(lambda s, a: a, timeout=10)
    assert (outcome.reason, outcome.http_status, outcome.released) == (
        FailureReason.REFUSED,
        400,
        True,
    )
    assert "too long" in outcome.error


def test_a_note_still_in_flight_when_the_end_is_reported_wins(pair, monkeypatch):
    """The report may come before the note (it is asked for at every heartbeat): a note that
    arrives within the grace ends the room as it says."""
    p = pair(timeout=30.0)
    notes_held(p, monkeypatch)
    p.prefill.open(122)
    p.prefill.prefilled(122, [1], note(122, token=99))
    p.decode.expect(p.target(122), [2])
    p.run(lambda s, a: p.decode._rooms[122].reported is not None)
    p.release_notes()
    _, [outcome] = p.run(lambda s, a: a)
    assert outcome.error is None and outcome.note.first_token == 99


def test_a_room_taken_before_the_connect_to_its_decode_engine_failed_fails_soon(pair, monkeypatch):
    """The scheduler took longer than the registration's wait to find the decode engine
    unreachable: the room posted meanwhile cannot be written, and no note can reach the
    decode side either (no connection); it waited its whole timeout."""
    monkeypatch.setattr(bootstrap_server, "CONNECT_WAIT_S", 0.2)
    p = pair(timeout=30.0)

    def slow_unreachable(metadata, layout):
        time.sleep(0.5)
        raise TransferError("adding the peer's agent: nixlBackendError: NIXL_ERR_BACKEND")

    monkeypatch.setattr(p.prefill_agent, "connect", slow_unreachable)
    p.prefill.open(124)
    p.prefill.prefilled(124, [1], note(124))
    p.decode.expect(p.target(124), [2])
    sent, [outcome] = p.run(lambda s, a: s and a, timeout=10)
    assert outcome.reason is FailureReason.TRANSFER and "is not connected" in outcome.error
    assert outcome.released and not sent[0].ok


def test_a_prefill_engine_that_reports_no_ends_leaves_the_rooms_waiting(pair, monkeypatch):
    """An older prefill engine answers 404 to the question (a rolling upgrade): its rooms
    wait for their notes as before, and its heartbeat still counts."""
    p = pair(timeout=30.0, dead_after_s=0.5)
    monkeypatch.setattr(p.server, "rooms_ended", lambda asked: (404, {"error": "no such path"}))
    notes = notes_held(p, monkeypatch)
    p.prefill.open(123)
    p.prefill.prefilled(123, [1], note(123, token=5))
    p.decode.expect(p.target(123), [2])
    p.run(lambda s, a: notes)
    time.sleep(1.0)  # two silences allowed, and many grace periods
    assert not p.decode.poll() and p.decode.waiting(123)
    p.release_notes()
    _, [outcome] = p.run(lambda s, a: a)
    assert outcome.note.first_token == 5


def stand_in_layout(agent: str) -> PoolLayout:
    """A pool of 8 slots of one layer at made-up addresses: what a bootstrap server is given
    where no KV moves."""
    return PoolLayout(
        agent=agent,
        memory="DRAM",
        device_id=0,
        slot_bytes=16,
        slot_shape=(2, 4),
        dtype="float16",
        num_slots=8,
        k_addresses=(1000,),
        v_addresses=(2000,),
    )


LAYOUT = stand_in_layout("prefill-agent")


def registration(engine: str, metadata: bytes = b"agent-1") -> PeerRegistration:
    layout = stand_in_layout(f"{engine}-agent")
    return PeerRegistration(engine, (RankAgent(metadata, layout),))


class FakeScheduler:
    """A bootstrap server whose scheduler side is faked: each registration's connect fails
    with `error` (None: it succeeds), answered from a thread as the scheduler would (the
    server emits with its lock held); `attempts` counts the connects tried."""

    def __init__(self, timeout_s: float = 60.0, **server_options: float):
        """`server_options`: the BootstrapServer's keyword arguments (its back-off, say)."""
        self.error: str | None = "no UCX transport in common"
        self.attempts = 0
        self.server = BootstrapServer(
            self.emit, ServeBootstrap(LAYOUT, 1, "127.0.0.1", 0, timeout_s), **server_options
        )

    def emit(self, fact) -> None:
        if isinstance(fact, PeerRegistered):
            self.attempts += 1
            threading.Thread(
                target=self.server.peer_connected, args=(PeerConnected(fact.engine, self.error),)
            ).start()


@pytest.fixture
def fake_scheduler():
    made: list[FakeScheduler] = []

    def make(**kwargs) -> FakeScheduler:
        made.append(FakeScheduler(**kwargs))
        return made[-1]

    yield make
    for side in made:
        side.server.close()


def test_a_decode_engine_that_cannot_be_reached_is_tried_again_only_after_a_back_off(
    fake_scheduler,
):
    """Each registration of a decode engine the prefill side could not connect to made every
    rank try again (one add_remote_agent each, on the scheduler's thread): one per request
    the decode engine got. It is refused at once with the error for a while, longer after
    each failure up to a cap; a decode engine with new agents (restarted) is tried at once."""
    side = fake_scheduler(retry_first_s=0.5, retry_max_s=1.0)
    server = side.server
    for _ in range(4):
        status, body = server.register(registration("decode-a"))
        assert status == 502 and "no UCX transport in common" in body["error"], body
    assert side.attempts == 1
    time.sleep(0.6)
    assert server.register(registration("decode-a"))[0] == 502 and side.attempts == 2
    time.sleep(0.6)  # the wait doubled: not yet
    assert server.register(registration("decode-a"))[0] == 502 and side.attempts == 2
    time.sleep(0.5)
    assert server.register(registration("decode-a"))[0] == 502 and side.attempts == 3
    time.sleep(1.1)  # at the cap
    assert server.register(registration("decode-a"))[0] == 502 and side.attempts == 4
    side.error = None
    status, _ = server.register(registration("decode-a", b"agent-2"))  # restarted: at once
    assert status == 200 and side.attempts == 5
    side.error = "no UCX transport in common"
    assert server.register(registration("decode-a", b"agent-2"))[0] == 502
    assert server.register(registration("decode-b"))[0] == 502  # another engine: its own
    assert side.attempts == 7


def test_the_back_off_of_a_decode_engine_gone_quiet_is_forgotten(fake_scheduler):
    side = fake_scheduler(retry_first_s=0.05)
    server = side.server
    assert server.register(registration("decode-a"))[0] == 502
    time.sleep(0.1)
    server.forget_idle_peers(idle_s=0)
    assert not server._unreachable


def test_the_prefill_side_remembers_ended_rooms_for_their_engine_and_a_while_only(
    fake_scheduler,
):
    side = fake_scheduler(timeout_s=0.2)
    server = side.server
    server.room_ended(RoomEnded("decode-a", RoomNote(5, RoomStatus.DONE)))
    failed = RoomNote(6, RoomStatus.FAILED, error="no", http_status=400)
    server.room_ended(RoomEnded("decode-a", failed))
    status, body = server.rooms_ended(RoomsBody("decode-a", (5, 6, 7)))
    assert status == 200
    assert body["ended"] == [
        {"room": 5, "status": "done", "error": None, "reason": None, "http_status": None},
        {"room": 6, "status": "failed", "error": "no", "reason": None, "http_status": 400},
    ]
    assert server.rooms_ended(RoomsBody("decode-b", (5, 6)))[1] == {"ended": []}
    time.sleep(0.5)  # twice the timeout: no request for those rooms comes any more
    server.room_ended(RoomEnded("decode-a", RoomNote(8, RoomStatus.CANCELLED, error="gone")))
    assert set(server._ended) == {8}


class CountedRooms(dict):
    """The server's posted rooms, counting the entries read through items()."""

    read = 0

    def items(self):
        for entry in super().items():
            self.read += 1
            yield entry


def test_posted_rooms_expire_oldest_first_and_a_post_reads_no_room_still_remembered(
    fake_scheduler,
):
    """Each post rebuilt the whole table of remembered rooms (two minutes of them by
    default): its cost grew with the rooms remembered. Rooms past the window are forgotten,
    with what was known of them, and the first one still remembered ends the expiry."""
    side = fake_scheduler()
    side.error = None
    server = side.server
    assert server.register(registration("decode-a"))[0] == 200

    def post(room: int) -> int:
        return server.post_room(RoomPostBody(room, "decode-a", (0,)))[0]

    server._room_memory_s = 0.1
    assert post(1) == 200
    server.room_writing(RoomWriting(1, writing=False))
    server.cancel_room(1, CancelBody("test"))
    # a room cancelled before its post is not kept: no expiry would forget it
    server.room_writing(RoomWriting(9, writing=False))
    assert (server._settled, server._cancelled) == ({1}, {1})
    time.sleep(0.15)
    assert post(2) == 200  # room 1 is forgotten, with what was known of it
    assert list(server._rooms) == [2] and (server._settled, server._cancelled) == (set(), set())
    server._room_memory_s = 60.0
    for room in range(3, 1003):
        assert post(room) == 200
    server._rooms = rooms = CountedRooms(server._rooms)
    assert post(1003) == 200
    assert rooms.read == 1  # the oldest room, still remembered: none of the other thousand
    assert len(server._rooms) == 1002 and post(2) == 409  # remembered: a duplicate


def test_the_bodies_keep_their_wire_format():
    """Field names and JSON as the previous version sends and reads them: engines of both
    pair up in a rolling upgrade."""
    rank = RankAgent(b"agent-1", LAYOUT)
    bodies = {
        PeerRegistration("decode-a", (rank,)): {
            "engine": "decode-a",
            "ranks": [{"metadata": "YWdlbnQtMQ==", "layout": dataclasses.asdict(LAYOUT)}],
        },
        RoomPostBody(7, "decode-a", (1, 2)): {"room": 7, "engine": "decode-a", "slots": [1, 2]},
        RoomsBody("decode-a", (7, 8)): {"engine": "decode-a", "rooms": [7, 8]},
        CancelBody("gone", True): {"reason": "gone", "aborted": True},
    }
    for body, wire in bodies.items():
        assert json.dumps(body.to_json()) == json.dumps(wire)
        assert type(body).from_json(json.loads(json.dumps(wire))) == body
    assert CancelBody.from_json({}) == CancelBody("", False)  # an older decode engine's


LAYOUT_JSON = dataclasses.asdict(LAYOUT)


def bad_layout(**fields) -> dict:
    """A registration whose pool layout has these fields changed or added."""
    return {"engine": "d", "ranks": [{"metadata": "", "layout": {**LAYOUT_JSON, **fields}}]}


@pytest.mark.parametrize(
    "method, path, body, named",
    [
        ("PUT", "/kv/peers", {"engine": "d"}, "field 'ranks' is missing"),
        ("PUT", "/kv/peers", {"engine": 5, "ranks": []}, "field 'engine' must be a string"),
        ("PUT", "/kv/peers", {"engine": "d", "ranks": [{"layout": LAYOUT_JSON}]},
         "field 'ranks[0].metadata' is missing"),
        ("PUT", "/kv/peers", bad_layout(num_slots="8"), "field 'ranks[0].layout.num_slots' must be"),
        ("PUT", "/kv/peers", bad_layout(slot_shape=[2, None]), "'ranks[0].layout.slot_shape[1]'"),
        ("PUT", "/kv/peers", bad_layout(extra=1), "field 'ranks[0].layout' has fields"),
        ("POST", "/kv/rooms", {"room": 9, "slots": [1]}, "field 'engine' is missing"),
        ("POST", "/kv/rooms", {"room": "9", "engine": "d", "slots": [1]}, "field 'room' must be"),
        ("POST", "/kv/rooms", {"room": 9, "engine": "d", "slots": 1}, "field 'slots' must be a list"),
        ("POST", "/kv/rooms/queued", {"engine": "d", "rooms": [1, True]}, "field 'rooms[1]'"),
        ("POST", "/kv/rooms/ended", {"rooms": [1]}, "field 'engine' is missing"),
        ("DELETE", "/kv/rooms/5", {"reason": 3}, "field 'reason' must be a string"),
        ("DELETE", "/kv/rooms/5", {"aborted": "yes"}, "field 'aborted' must be true or false"),
        ("DELETE", "/kv/rooms/x", {}, "the room in the path must be"),
    ],
)  # fmt: skip
def test_a_body_unlike_its_request_s_is_refused_naming_the_field(
    fake_scheduler, method, path, body, named
):
    side = fake_scheduler()
    answer = httpx.request(method, f"http://127.0.0.1:{side.server.port}{path}", json=body)
    assert answer.status_code == 400 and named in answer.json()["error"], answer.text
    assert side.attempts == 0  # no registration was tried


def test_a_fault_of_the_server_is_answered_500_and_logged(fake_scheduler, caplog):
    """A bug in a route's method is the server's, not the caller's: a 500 naming it, not a
    dropped connection (which a decode engine reads as the prefill engine gone)."""
    side = fake_scheduler()

    def broken() -> tuple[int, dict]:
        raise KeyError("a bug")

    side.server.health = broken
    with caplog.at_level(logging.ERROR, logger="kubesgl.engine.disagg.bootstrap_server"):
        answer = httpx.get(f"http://127.0.0.1:{side.server.port}/health")
    assert answer.status_code == 500 and "KeyError" in answer.json()["error"], answer.text
    assert any(record.exc_info for record in caplog.records)


def test_a_peer_that_stalls_or_leaves_is_no_fault_of_the_server(fake_scheduler, caplog):
    """A read that times out or a connection reset while the body comes is closed without an
    answer or an error logged, as http.server does (not a 500 for a paused decode engine)."""
    side = fake_scheduler()

    def reset() -> tuple[int, dict]:
        raise ConnectionResetError("the peer left")

    side.server.health = reset
    with caplog.at_level(logging.ERROR, logger="kubesgl.engine.disagg.bootstrap_server"):
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://127.0.0.1:{side.server.port}/health")
    assert not caplog.records


def test_a_body_nested_too_deep_to_read_is_a_400(fake_scheduler):
    side = fake_scheduler()
    deep = "[" * 100_000 + "]" * 100_000
    answer = httpx.post(
        f"http://127.0.0.1:{side.server.port}/kv/rooms",
        content=f'{{"engine": {deep}}}',
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400 and "RecursionError" in answer.json()["error"], answer.text


class RankOneNotes(RankConsensus):
    """Rank 0 of two, with rank 1's facts made up: `arrive` hands its notes to the next turn."""

    def __init__(self):
        super().__init__(0, 2, group=object())  # type: ignore[arg-type] - never used
        self.rank_one: list = []

    def arrive(self, note: RoomNote) -> None:
        self.rank_one.append(NoteArrived(1, note))

    def share(self, local):
        shared, self.rank_one = local + self.rank_one, []
        return shared


def test_a_note_of_another_rank_in_the_turn_the_report_falls_due_wins(pair, monkeypatch):
    """Rank 0 finds the reported end overdue in the very turn that brings rank 1's note (rank
    0's came already): the note wins on every rank, as on one. Rank 0's overdue fact came
    before rank 1's notes in the shared list, and failed a room whose KV had all arrived."""
    p = pair(timeout=30.0)
    p.decode.consensus = ranks = RankOneNotes()
    notes = notes_held(p, monkeypatch)
    p.prefill.open(125)
    p.prefill.prefilled(125, [1], note(125, token=42))
    p.decode.expect(p.target(125), [2])
    p.run(lambda s, a: notes and p.decode._rooms[125].reported is not None)
    p.release_notes()  # rank 0's note, in this turn
    ranks.arrive(RoomNote.decode(notes[0]))  # rank 1's, in the same turn
    p.decode._rooms[125].note_due_at = time.monotonic()  # and the report falls due in it
    _, [outcome] = p.run(lambda s, a: a)
    assert outcome.error is None and outcome.note.first_token == 42, outcome


def test_a_burst_of_posts_waits_in_the_listen_backlog_instead_of_being_dropped(pair):
    """Decode posts arriving faster than the bootstrap server's accept loop takes them (its
    thread short of the GIL on a busy engine) waited in a listen backlog of 5: the kernel
    dropped the connections beyond it, and each such decode engine's connect timed out (3 s)
    and failed its room as peer_lost, the prefill engine alive. Here the accept loop is held
    while 64 connections arrive: every one must be established."""
    p = pair()
    http = p.server._http
    accept, release = http.get_request, threading.Event()

    def held_accept():
        release.wait(10)
        return accept()

    http.get_request = held_accept
    burst = []
    try:
        for _ in range(64):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", p.server.port))
            burst.append(s)
        deadline, established = time.monotonic() + 2.0, set()
        while len(established) < len(burst) and time.monotonic() < deadline:
            _, writable, _ = select.select([], [s for s in burst if s not in established], [], 0.1)
            established |= {
                s for s in writable if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            }
        assert len(established) == len(burst)
    finally:
        release.set()
        http.get_request = accept
        for s in burst:
            s.close()
