"""Prefill side of a room: pairs the prompts this engine has prefilled with the slots their
decode engines posted, writes the KV there over NIXL, and says how each room ended.

Every rank holds the same room table and changes it only by applying the facts every rank
shares (ranks.py): rank 0 contributes what arrived at the bootstrap server (from the
bootstrap process) and the rooms it timed out, each rank the writes of its own shard that
ended. A room counts as sent once the writes of all ranks are done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

from kubesgl.engine.disagg.kv_transfer import KVTransferAgent, Transfer, TransferError
from kubesgl.engine.disagg.link import BootstrapLink
from kubesgl.engine.disagg.protocol import (
    BootstrapFact,
    FailureReason,
    PeerConnected,
    PeerForgotten,
    PeerRegistered,
    RoomCancelled,
    RoomEnded,
    RoomNote,
    RoomPosted,
    RoomsQueued,
    RoomStatus,
    RoomWriting,
    ServeBootstrap,
)
from kubesgl.engine.disagg.ranks import RankConsensus

logger = logging.getLogger(__name__)

# How long a prefill engine that shuts down keeps its bootstrap server up for writes still in
# flight (the server's launcher stops its processes 5 s after this).
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class WriteEnded:
    rank: int
    room: int
    nbytes: int
    seconds: float
    error: str | None = None  # None: done


@dataclass(frozen=True)
class WriteOverdue:
    """This rank's write has run past the timeout: its request fails now, but the room stays
    busy until NIXL says the write ended. A write cannot be called back: releasing its
    handle leaves its puts running (UCX cancels receives only), so they could land in
    slots the decode engine had handed to another request."""

    rank: int
    room: int
    error: str


@dataclass(frozen=True)
class ConnectTried:
    """One rank's attempt to connect to a registered decode engine's NIXL agent."""

    rank: int
    engine: str
    error: str | None = None  # None: connected


@dataclass(frozen=True)
class RoomTimedOut:
    room: int
    error: str


@dataclass(frozen=True)
class RoomsForgotten:
    """Posts and closed rooms old enough that no request for them is coming any more."""

    rooms: tuple[int, ...]


PrefillFact = (
    PeerRegistered
    | PeerForgotten
    | RoomPosted
    | RoomCancelled
    | RoomsQueued
    | WriteEnded
    | WriteOverdue
    | ConnectTried
    | RoomTimedOut
    | RoomsForgotten
)


@dataclass(frozen=True)
class ClosingTurn:
    """One rank's state in a turn of `PrefillTransfers.close`."""

    rank: int
    writes: int  # this rank's writes still in flight
    expired: bool  # the wait is over (rank 0's clock decides for every rank)


@dataclass(frozen=True)
class PrefillOutcome:
    """How a room this engine prefilled ended: its KV is at the decode engine, or not."""

    room: int
    error: str | None = None
    reason: FailureReason | None = None
    nbytes: int = 0  # KV bytes written, over all ranks, and the write's time
    seconds: float = 0.0
    waited: float = 0.0  # from the request's arrival to the decode side's slots

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Room:
    """A room whose request runs here."""

    opened_at: float
    target: RoomPosted | None = None  # where its KV goes, once the decode engine posted it
    src_slots: list[int] | None = None  # set once the prompt is prefilled
    note: RoomNote | None = None  # what the decode engine gets with the KV
    writing: set[int] = field(default_factory=set)  # ranks whose write is still in flight
    started: bool = False
    failed: bool = False
    write_error: str | None = None  # the first rank's write that failed: its note said so
    nbytes: int = 0  # the write's size over all ranks, and its time on this rank
    seconds: float = 0.0
    waited: float = 0.0  # this rank: from the request's arrival to the decode side's slots


@dataclass(frozen=True)
class _Queued:
    """A room a decode engine said it has queued, its slots not posted yet."""

    engine: str  # told at once should the room end here before its post
    at: float  # when it last said so (rank 0's clock decides the timeouts)


@dataclass
class _Write:
    """A write of this rank in flight."""

    transfer: Transfer
    started_at: float
    overdue: bool = False  # past the timeout: its request has failed, the write goes on


class PrefillTransfers:
    def __init__(
        self,
        agent: KVTransferAgent,
        consensus: RankConsensus,
        link: BootstrapLink | None,
        timeout: float,
        host: str,
        port: int,
    ):
        """`link` (rank 0, and rank 0 alone): the bootstrap process, which serves the
        bootstrap server on host:port for this engine."""
        if consensus.is_leader != (link is not None):
            raise ValueError("rank 0, and rank 0 alone, talks to the bootstrap process")
        self.agent, self.consensus, self.link, self.timeout = agent, consensus, link, timeout
        if link is not None:
            link.send(
                ServeBootstrap(agent.layout, consensus.tp_size, host, port, timeout_s=timeout)
            )
        self._peer_agents: dict[str, str] = {}  # decode engine -> its agent of this rank
        self._connect_tries: dict[str, dict[int, str | None]] = {}  # engine -> each rank's error
        self._unreachable: dict[str, str] = {}  # decode engines last found unreachable: why
        self._rooms: dict[int, _Room] = {}
        self._posted: dict[int, RoomPosted] = {}  # posts whose request has not come (yet)
        self._closed: dict[int, RoomNote] = {}  # rooms that ended here before their post came
        self._seen_at: dict[int, float] = {}  # rank 0: when each post or closed room appeared
        self._queued: dict[int, _Queued] = {}  # rooms decode engines queued, not posted yet
        self._writes: dict[int, _Write] = {}  # this rank's writes in flight
        # this rank's facts for the next turn; facts the bootstrap link brings that are not the
        # prefill side's (the decode side's PostFailed...) are ignored
        self._local: list[PrefillFact | BootstrapFact] = []

    # -- the scheduler's side ----------------------------------------------------------
    def closed(self, room: int) -> str | None:
        """Why a request for `room` cannot run here (the decode engine gave up on the room
        already), or None."""
        note = self._closed.get(room)
        return None if note is None else note.error

    def open(self, room: int) -> None:
        """A request for `room` is queued here."""
        if room in self._rooms or room in self._closed:
            raise ValueError(f"room {room} is already in use")
        self._rooms[room] = _Room(time.monotonic(), target=self._posted.pop(room, None))

    def posted(self, room: int) -> bool:
        """Whether the decode engine has posted the room's slots: its KV has a place there.
        Only then is its prompt computed here (PrefillRole.may_admit)."""
        state = self._rooms.get(room)
        return state is not None and state.target is not None

    def prefilled(self, room: int, src_slots: list[int], note: RoomNote) -> None:
        """The prompt of `room` is in the pool at `src_slots`; `note` carries its first token.
        The slots must stay untouched while `busy(room)`."""
        state = self._rooms[room]
        state.src_slots, state.note = list(src_slots), note

    def abandon(
        self, room: int, reason: FailureReason, error: str, http_status: int | None = None
    ) -> None:
        """The request of `room` ended here without its KV sent (refused, aborted, failed):
        tell the decode engine now, or when its post arrives."""
        state = self._rooms.get(room)
        if state is not None and state.writing:
            return  # the write in flight ends the room and tells the decode side
        self._rooms.pop(room, None)
        note = RoomNote(
            room, RoomStatus.FAILED, error=error, reason=reason, http_status=http_status
        )
        target = state.target if state is not None else self._posted.pop(room, None)
        if target is not None:
            self._last_word(target.engine, note)
        else:
            self._close(room, note)

    def busy(self, room: int) -> bool:
        """True while this engine may still be reading the room's slots."""
        state = self._rooms.get(room)
        return state is not None and bool(state.writing)

    def has_work(self) -> bool:
        """Rooms open, or facts of this rank not shared yet (a connect tried, which a decode
        engine's registration waits for): the scheduler must turn again soon, not idle."""
        return bool(self._rooms or self._local)

    # -- each turn ---------------------------------------------------------------------
    def poll(self) -> list[PrefillOutcome]:
        """Applies what every rank saw since the last turn; starts the writes that can start.
        A collective on more than one rank."""
        local, self._local = self._local, []
        local += self._ended_writes()
        if self.link is not None:
            local += self.link.drain()
            local += self._leader_clock()
        outcomes: list[PrefillOutcome] = []
        for fact in self.consensus.share(local):
            outcomes += self._apply(fact)
        self._start_writes()
        return outcomes

    def _apply(self, fact: PrefillFact | BootstrapFact) -> list[PrefillOutcome]:
        handler = _HANDLERS.get(type(fact))  # none for the decode side's facts
        return (handler(self, fact) or []) if handler is not None else []

    def _room_posted(self, fact: RoomPosted) -> None:
        state = self._rooms.get(fact.room)
        self._queued.pop(fact.room, None)  # its slots have come: queued there no more
        if state is not None:
            state.target, state.waited = fact, time.monotonic() - state.opened_at
        elif fact.room in self._closed:
            self._last_word(fact.engine, self._closed.pop(fact.room))
        else:
            self._posted[fact.room] = fact
            self._remember(fact.room)

    def _rooms_queued(self, fact: RoomsQueued) -> None:
        now = time.monotonic()
        for room in fact.rooms:
            self._queued[room] = _Queued(fact.engine, now)
            # it ended here before the decode engine said so (or the note was lost)
            if room in self._closed:
                self._notify(fact.engine, self._closed[room])

    def _room_timed_out(self, fact: RoomTimedOut) -> list[PrefillOutcome]:
        state = self._rooms.get(fact.room)
        # rank 0's clock ran before this turn's facts: a post among them came in time
        if state is None or state.target is not None:
            return []
        del self._rooms[fact.room]
        self._close(
            fact.room,
            RoomNote(fact.room, RoomStatus.FAILED, error=fact.error, reason=FailureReason.TIMEOUT),
        )
        return [PrefillOutcome(fact.room, fact.error, FailureReason.TIMEOUT)]

    def _forget_rooms(self, fact: RoomsForgotten) -> None:
        for room in fact.rooms:
            self._posted.pop(room, None)
            self._closed.pop(room, None)
            self._seen_at.pop(room, None)
            self._queued.pop(room, None)

    def _connect(self, fact: PeerRegistered) -> None:
        """Connects this rank; every rank's outcome is shared, and the registration answered
        with it (`_connect_tried`)."""
        mine = fact.ranks[self.consensus.rank]
        error = None
        if self._peer_agents.get(fact.engine) != mine.layout.agent:
            try:
                self.agent.connect(mine.metadata, mine.layout)
                self._peer_agents[fact.engine] = mine.layout.agent
            except Exception as exc:  # noqa: BLE001 - the registration is refused with it
                error = str(exc)
        self._local.append(ConnectTried(self.consensus.rank, fact.engine, error))

    def _connect_tried(self, fact: ConnectTried) -> None:
        tries = self._connect_tries.setdefault(fact.engine, {})
        tries[fact.rank] = fact.error
        if len(tries) < self.consensus.tp_size:
            return
        del self._connect_tries[fact.engine]
        error = next((e for e in tries.values() if e is not None), None)
        if self.link is None:  # rank 0 answers the registration, and logs for the engine
            return
        # A decode engine that cannot be reached registers again with every request it
        # gets: one line when its error is new, not one per request.
        if error is None:
            self._unreachable.pop(fact.engine, None)
        elif self._unreachable.get(fact.engine) != error:
            self._unreachable[fact.engine] = error
            logger.error(
                "decode engine %s cannot be reached over NIXL (its registration is refused "
                "until it can): %s",
                fact.engine,
                error,
            )
        self.link.send(PeerConnected(fact.engine, error))

    def _disconnect(self, fact: PeerForgotten) -> None:
        """A decode engine gone quiet: its connection goes, unless a room here still writes
        there (it registers again with its next post, if it was only idle)."""
        engine = fact.engine
        targets = [state.target for state in self._rooms.values()] + list(self._posted.values())
        if engine not in self._peer_agents or any(t and t.engine == engine for t in targets):
            return
        try:
            self.agent.disconnect(self._peer_agents.pop(engine))
        except TransferError as exc:  # it is forgotten here all the same
            logger.warning("disconnecting from decode engine %s: %s", engine, exc)

    def _cancel(self, fact: RoomCancelled) -> list[PrefillOutcome]:
        error = f"room {fact.room} was cancelled: {fact.reason or 'no reason given'}"
        # Its client left: the request is aborted here too, as if this engine's client had left.
        reason = FailureReason.ABORTED if fact.aborted else FailureReason.REFUSED
        note = RoomNote(fact.room, RoomStatus.CANCELLED, error=error, reason=reason)
        state = self._rooms.get(fact.room)
        if state is not None and state.started:
            return []  # the write in flight ends the room and tells the decode side
        if self.link is not None:  # no write runs, nor will: the bootstrap server may say so
            self.link.send(RoomWriting(fact.room, writing=False))
        if state is None:  # its request has not come (yet): refuse it if it does
            posted = self._posted.pop(fact.room, None)
            if posted is not None:
                self._last_word(posted.engine, note)
            self._close(fact.room, note)
            return []
        del self._rooms[fact.room]
        if state.target is not None:
            self._last_word(state.target.engine, note)
        return [PrefillOutcome(fact.room, error, reason)]

    def _write_ended(self, fact: WriteEnded) -> list[PrefillOutcome]:
        state = self._rooms.get(fact.room)
        if state is None:
            return []
        state.writing.discard(fact.rank)
        if fact.rank == self.consensus.rank:
            state.nbytes, state.seconds = fact.nbytes * self.consensus.tp_size, fact.seconds
        if fact.error is not None and state.write_error is None:
            state.write_error = fact.error
        outcomes = [] if fact.error is None else self._fail(fact.room, state, fact.error)
        if not state.writing:
            del self._rooms[fact.room]
            if self.link is not None:
                self.link.send(RoomWriting(fact.room, writing=False))
            assert state.target is not None  # a write starts only once the room is posted
            # every rank's note went with its write, or said that it failed
            self._report(
                state.target.engine,
                RoomNote(fact.room, RoomStatus.DONE)
                if state.write_error is None
                else RoomNote(
                    fact.room,
                    RoomStatus.FAILED,
                    error=state.write_error,
                    reason=FailureReason.TRANSFER,
                ),
            )
            if not state.failed:
                outcomes.append(
                    PrefillOutcome(
                        fact.room, nbytes=state.nbytes, seconds=state.seconds, waited=state.waited
                    )
                )
        return outcomes

    def _write_overdue(self, fact: WriteOverdue) -> list[PrefillOutcome]:
        state = self._rooms.get(fact.room)
        return [] if state is None else self._fail(fact.room, state, fact.error)

    @staticmethod
    def _fail(room: int, state: _Room, error: str) -> list[PrefillOutcome]:
        """The room's request fails, with the first error to arrive; its write may go on."""
        if state.failed:
            return []
        state.failed = True
        return [PrefillOutcome(room, error, FailureReason.TRANSFER)]

    def _start_writes(self) -> None:
        for room, state in self._rooms.items():
            # src_slots and note are set together, once the prompt is prefilled
            if (
                state.started
                or state.src_slots is None
                or state.note is None
                or state.target is None
            ):
                continue
            state.started, state.writing = True, set(range(self.consensus.tp_size))
            if self.link is not None:  # a cancel must not free the slots while it runs
                self.link.send(RoomWriting(room, writing=True))
            peer = self._peer_agents.get(state.target.engine)
            try:
                if peer is None:
                    raise RuntimeError(f"decode engine {state.target.engine} is not connected")
                if len(state.target.slots) != len(state.src_slots):
                    raise ValueError(
                        f"the decode engine allocated {len(state.target.slots)} slots for a "
                        f"{len(state.src_slots)}-token prompt"
                    )
                transfer = self.agent.write(
                    peer, state.src_slots, list(state.target.slots), state.note.encode()
                )
                self._writes[room] = _Write(transfer, time.monotonic())
            except (KeyError, ValueError, RuntimeError) as exc:
                self._local.append(
                    self._failed_write(room, state.target.engine, f"KV transfer not started: {exc}")
                )

    def _ended_writes(self) -> list[WriteEnded | WriteOverdue]:
        """This rank's writes that ended since the last turn, and those that went overdue. A
        write's end is the room's last word (NIXL's note with the KV, or FAILED), so it is
        only ever said once NIXL reports the write done or failed."""
        ended: list[WriteEnded | WriteOverdue] = []
        now = time.monotonic()
        for room, write in list(self._writes.items()):
            target = self._rooms[room].target
            assert target is not None  # a write starts only once the decode engine posted the room
            try:
                done = self.agent.done(write.transfer)
            except RuntimeError as exc:
                del self._writes[room]
                ended.append(self._failed_write(room, target.engine, str(exc)))
                continue
            if done:
                del self._writes[room]
                ended.append(
                    WriteEnded(
                        self.consensus.rank, room, write.transfer.nbytes, now - write.started_at
                    )
                )
            elif not write.overdue and now - write.started_at > self.timeout:
                write.overdue = True
                logger.warning(
                    "room %d: the KV write to %s has not finished within %g s; its request "
                    "fails, its slots stay held until the write ends",
                    room,
                    target.engine,
                    self.timeout,
                )
                error = f"the KV write did not finish within {self.timeout:g} s"
                ended.append(WriteOverdue(self.consensus.rank, room, error))
        return ended

    def _failed_write(self, room: int, engine: str, error: str) -> WriteEnded:
        """This rank's write failed: its decode rank gets no notification from the write, so
        it gets one saying so."""
        self._notify(
            engine, RoomNote(room, RoomStatus.FAILED, error=error, reason=FailureReason.TRANSFER)
        )
        return WriteEnded(self.consensus.rank, room, 0, 0.0, error)

    def _leader_clock(self) -> list[PrefillFact]:
        """Rank 0 decides what has waited too long, for every rank. A room its decode engine
        keeps saying it has queued waits as long as that engine lives."""
        now = time.monotonic()
        facts: list[PrefillFact] = [
            RoomTimedOut(room, f"no decode engine asked for room {room} within {self.timeout:g} s")
            for room, state in self._rooms.items()
            if state.target is None
            and now - max(state.opened_at, self._queued[room].at if room in self._queued else 0.0)
            > self.timeout
        ]
        old = tuple(room for room, seen in self._seen_at.items() if now - seen > 2 * self.timeout)
        old += tuple(
            room
            for room, queued in self._queued.items()
            if now - queued.at > 2 * self.timeout and room not in self._seen_at
        )
        if old:
            facts.append(RoomsForgotten(old))
        return facts

    def _close(self, room: int, note: RoomNote) -> None:
        """The room ended here before its post came. A decode engine that said it queued the
        room gets the note now (its request fails there at once, not once it is admitted and
        posts the room, which answers with the note again); any other, when it posts."""
        self._closed[room] = note
        self._remember(room)
        queued = self._queued.get(room)
        if queued is not None:
            self._notify(queued.engine, note)

    def _remember(self, room: int) -> None:
        if self.link is not None:
            self._seen_at[room] = time.monotonic()

    def _last_word(self, engine: str, note: RoomNote) -> None:
        """The room ended here without a write: every rank's note says so to the decode
        engine's same rank, and the bootstrap server, should a note not arrive."""
        self._notify(engine, note)
        self._report(engine, note)

    def _report(self, engine: str, note: RoomNote) -> None:
        """Rank 0: the room's last word went out (NIXL may not deliver it: a firewall after
        the handshake, a lost note); the decode engine asks the bootstrap server for it."""
        if self.link is not None:
            self.link.send(RoomEnded(engine, note))

    def _notify(self, engine: str, note: RoomNote) -> None:
        peer = self._peer_agents.get(engine)
        if peer is None:
            logger.warning(
                "room %d ended (%s) but decode engine %s is not connected",
                note.room,
                note.status,
                engine,
            )
            return
        try:
            self.agent.notify(peer, note.encode())
        except TransferError as exc:  # the decode side times the room out instead
            # one line: a dead decode engine fails the notes of all its rooms the same way
            logger.warning(
                "telling decode engine %s that room %d ended failed: %s", engine, note.room, exc
            )

    def close(self, within: float = CLOSE_WAIT_S) -> None:
        """Stops the bootstrap server and the NIXL agent once every rank's writes in flight
        have ended, waiting at most `within`: a write cannot be called back, and a decode
        engine frees the slots it posted here as soon as this engine stops answering. Ranks
        decide together when to stop waiting. A collective on more than one rank."""
        deadline = time.monotonic() + within
        while True:
            self._ended_writes()  # at shutdown no request waits for what they say
            turn = ClosingTurn(self.consensus.rank, len(self._writes), time.monotonic() > deadline)
            turns = self.consensus.share([turn])
            in_flight = sum(t.writes for t in turns)
            if not in_flight:
                break
            if turns[0].expired:
                if self.consensus.is_leader:
                    logger.error(
                        "closing with %d KV writes still in flight after %g s: their decode "
                        "engines may reuse the slots they write into",
                        in_flight,
                        within,
                    )
                break
            time.sleep(0.005)
        if self.link is not None:
            self.link.close()
        self.agent.close()


# How each fact changes the rooms: every member of PrefillFact has its handler, which returns
# the outcomes for the scheduler, if any.
_HANDLERS: dict[type, Callable[[PrefillTransfers, Any], list[PrefillOutcome] | None]] = {
    PeerRegistered: PrefillTransfers._connect,
    PeerForgotten: PrefillTransfers._disconnect,
    RoomPosted: PrefillTransfers._room_posted,
    RoomCancelled: PrefillTransfers._cancel,
    RoomsQueued: PrefillTransfers._rooms_queued,
    WriteEnded: PrefillTransfers._write_ended,
    WriteOverdue: PrefillTransfers._write_overdue,
    ConnectTried: PrefillTransfers._connect_tried,
    RoomTimedOut: PrefillTransfers._room_timed_out,
    RoomsForgotten: PrefillTransfers._forget_rooms,
}
assert set(_HANDLERS) == set(get_args(PrefillFact))
