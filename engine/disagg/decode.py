"""Decode side of a room: asks the prefill engine for a request's prompt KV, and tells the
scheduler when it has arrived, when the room failed, and when the room's slots may be used
again.

Slots a prefill engine may still write into are never handed back early: after a failure,
a timeout or an abort, the slots are released only once the prefill engine's last word on
the room has come from every rank (`RoomNote`), or it reported that word over HTTP and the
note still has not come (`EndReported`), or the prefill engine says it never had the room,
or it is dead. Every rank applies the same facts in the same order (ranks.py): each
rank contributes the notes its NIXL agent received, rank 0 what the bootstrap process
learned over HTTP and the rooms its clock timed out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

from kubesgl.engine.disagg.kv_transfer import KVTransferAgent
from kubesgl.engine.disagg.link import BootstrapLink
from kubesgl.engine.disagg.protocol import (
    BootstrapFact,
    CancelConfirmed,
    CancelRoom,
    CancelUnknown,
    ConnectBootstrap,
    EndReported,
    FailureReason,
    ForgetRoom,
    PeerLost,
    PostFailed,
    PostRoom,
    RoomNote,
    RoomStatus,
    StillQueued,
)
from kubesgl.engine.disagg.ranks import RankConsensus
from kubesgl.engine.messages import BootstrapTarget

logger = logging.getLogger(__name__)

# How long a room's note may come after its prefill engine reported the room's end over
# HTTP, which the heartbeat asks for and may overtake the note in flight: the note (it
# carries the first token) wins within this, and the report ends the room after it.
NOTE_GRACE_S = 1.0


@dataclass(frozen=True)
class NoteArrived:
    rank: int
    note: RoomNote


@dataclass(frozen=True)
class KVTimedOut:
    room: int


@dataclass(frozen=True)
class LastWordOverdue:
    """The prefill engine confirmed a cancel long enough ago that no write can come, yet its
    last word on the room has not (a notification lost): the slots may be used again."""

    room: int


@dataclass(frozen=True)
class NoteOverdue:
    """The prefill engine reported `NOTE_GRACE_S` ago that it ended the room as `note` says,
    and its note has not come from every rank (NIXL did not deliver it): the report is its
    last word."""

    note: RoomNote


# What changes a room, in the same order on every rank: what this side's ranks saw, and
# what rank 0's bootstrap process learned from the prefill engines
DecodeFact = (
    NoteArrived
    | KVTimedOut
    | LastWordOverdue
    | NoteOverdue
    | PostFailed
    | CancelUnknown
    | CancelConfirmed
    | EndReported
    | PeerLost
)


@dataclass(frozen=True)
class DecodeOutcome:
    """News of one room: its KV arrived (`note` holds the first token), it failed
    (`error`), and/or its slots may be used again (`released`)."""

    room: int
    note: RoomNote | None = None
    waited: float = 0.0  # seconds from asking to arrival (this rank's clock)
    error: str | None = None
    reason: FailureReason | None = None
    http_status: int | None = None  # the prefill engine's status for a request it refused
    released: bool = False


@dataclass
class _Room:
    target: BootstrapTarget
    asked_at: float
    notes: dict[int, RoomNote] = field(default_factory=dict)  # each rank's note, once it came
    waiting: bool = True  # its request still waits for the KV
    timed_out: bool = False  # rank 0: the timeout was announced
    release_at: float | None = None  # rank 0: when the slots are free without a last word
    reported: RoomNote | None = None  # rank 0: the prefill engine's report of the room's end
    note_due_at: float | None = None  # rank 0: when the report ends the room, its note absent


class DecodeTransfers:
    def __init__(
        self,
        agent: KVTransferAgent,
        consensus: RankConsensus,
        link: BootstrapLink | None,
        timeout: float,
        connect: ConnectBootstrap,
    ):
        """`link` (rank 0, and rank 0 alone): the bootstrap process, which talks to the
        prefill engines as `connect` says."""
        if consensus.is_leader != (link is not None):
            raise ValueError("rank 0, and rank 0 alone, talks to the bootstrap process")
        self.agent, self.consensus, self.link, self.timeout = agent, consensus, link, timeout
        if link is not None:
            link.send(connect)
        self._rooms: dict[int, _Room] = {}
        self._queued: dict[int, BootstrapTarget] = {}  # rooms of requests not admitted yet
        self._queue_told_at = 0.0  # rank 0: when the prefill engines last heard of them all
        # rank 0: rooms queued since the last turn, and those queued before it, which that
        # turn's admissions left queued: their prefill engines hear of these at once, so that
        # a room ended there first (a refused request) fails here now, not once it is posted
        self._new: set[int] = set()
        self._left_queued: set[int] = set()

    def queue(self, target: BootstrapTarget) -> None:
        """A request for `target` waits for admission here: its prefill engine must keep the
        prompt's KV meanwhile, however long that takes."""
        self._queued[target.room] = target
        if self.link is not None:
            self._new.add(target.room)

    def expect(self, target: BootstrapTarget, dst_slots: list[int]) -> None:
        """Ask the prefill engine of `target` to write the prompt's KV into `dst_slots`."""
        if target.room in self._rooms:
            raise ValueError(f"room {target.room} is already in use")
        self._queued.pop(target.room, None)
        self._rooms[target.room] = _Room(target, time.monotonic())
        if self.link is not None:
            self.link.send(PostRoom(target.room, target.address, tuple(dst_slots)))

    def cancel(self, room: int, reason: str, aborted: bool = False) -> None:
        """The request no longer waits (aborted, failed): tell the prefill engine; the slots
        stay taken until a `released` outcome. `aborted`: its client left, which the prefill
        engine's request becomes too."""
        state = self._rooms[room]
        if state.waiting:
            state.waiting = False
            if self.link is not None:
                self.link.send(CancelRoom(room, state.target.address, reason, aborted))

    def refuse(self, target: BootstrapTarget, reason: str, aborted: bool = False) -> None:
        """A request this engine will not run: its prefill engine may drop the room at once."""
        self._queued.pop(target.room, None)
        if self.link is not None:
            self.link.send(CancelRoom(target.room, target.address, reason, aborted))

    def unqueue(self, target: BootstrapTarget, reason: str, aborted: bool = False) -> None:
        """A queued request ended here before its admission: `refuse`, unless the prefill
        engine ended the room first (its note failed the request)."""
        if target.room in self._queued:
            self.refuse(target, reason, aborted)

    def has_rooms(self) -> bool:
        return bool(self._rooms or self._queued)

    def waiting(self, room: int) -> bool:
        """True while the room's request waits for its KV."""
        state = self._rooms.get(room)
        return state is not None and state.waiting

    def poll(self) -> list[DecodeOutcome]:
        """Applies what every rank saw since the last turn. A collective on more than one rank."""
        local: list[DecodeFact | BootstrapFact] = [
            NoteArrived(self.consensus.rank, note)
            for note in map(_note_or_none, self.agent.notifications())
            if note is not None
        ]
        if self.link is not None:
            local += self.link.drain()
            now = time.monotonic()
            self._tell_queued(now)
            for room, state in self._rooms.items():
                if state.waiting and not state.timed_out and now - state.asked_at > self.timeout:
                    state.timed_out = True
                    local.append(KVTimedOut(room))
                if state.release_at is not None and now > state.release_at:
                    state.release_at = None
                    local.append(LastWordOverdue(room))
                if state.note_due_at is not None and now > state.note_due_at:
                    assert state.reported is not None  # set together
                    state.note_due_at = None
                    local.append(NoteOverdue(state.reported))
        outcomes: list[DecodeOutcome] = []
        # A note that came this turn, from any rank, wins over the report it was overdue for:
        # rank 0's overdue facts would come before the notes of the ranks after it
        for fact in sorted(self.consensus.share(local), key=lambda f: isinstance(f, NoteOverdue)):
            outcomes += self._apply(fact)
        return outcomes

    def _tell_queued(self, now: float) -> None:
        """Rank 0: the prefill engines hear which rooms wait here: each as soon as a turn's
        admissions have left it queued, and all every quarter of the timeout (so that they
        never time its request out)."""
        assert self.link is not None  # rank 0 alone talks to the bootstrap process
        if self._queued and now - self._queue_told_at > self.timeout / 4:
            self._queue_told_at = now
            rooms = list(self._queued)
        else:
            rooms = [room for room in self._left_queued if room in self._queued]
        self._left_queued, self._new = self._new, set()
        by_address: dict[str, list[int]] = {}
        for room in rooms:
            by_address.setdefault(self._queued[room].address, []).append(room)
        for address, rooms in by_address.items():
            self.link.send(StillQueued(address, tuple(rooms)))

    def _apply(self, fact: DecodeFact | BootstrapFact) -> list[DecodeOutcome]:
        handler = _HANDLERS.get(type(fact))
        if handler is None:
            raise TypeError(f"not a decode-side fact: {fact!r}")
        return handler(self, fact)

    def _timed_out(self, fact: KVTimedOut) -> list[DecodeOutcome]:
        state = self._rooms.get(fact.room)
        if state is None or not state.waiting:
            return []
        self.cancel(fact.room, "the decode engine timed the room out")
        error = f"room {fact.room}'s KV did not arrive within {self.timeout:g} s"
        return [DecodeOutcome(fact.room, error=error, reason=FailureReason.TIMEOUT)]

    def _post_failed(self, fact: PostFailed) -> list[DecodeOutcome]:
        state = self._rooms.get(fact.room)
        if fact.maybe_taken:  # as a timeout: fail the request, keep the slots until told
            if state is None or not state.waiting:
                return []
            self.cancel(fact.room, fact.error)
            return [DecodeOutcome(fact.room, error=fact.error, reason=fact.reason)]
        # Its request may run there all the same, unless the room is another's (a 409)
        if state is not None and self.link is not None and fact.http_status != 409:
            self.link.send(CancelRoom(fact.room, state.target.address, fact.error))
        return self._end(fact.room, fact.error, fact.reason, fact.http_status)

    def _cancel_unknown(self, fact: CancelUnknown) -> list[DecodeOutcome]:
        return self._end(fact.room, None, None)

    def _cancel_confirmed(self, fact: CancelConfirmed) -> list[DecodeOutcome]:
        state = self._rooms.get(fact.room)
        if state is not None and self.link is not None:
            state.release_at = time.monotonic() + fact.release_after_s
        return []

    def _last_word_overdue(self, fact: LastWordOverdue) -> list[DecodeOutcome]:
        if fact.room in self._rooms:
            logger.warning(
                "room %d: the prefill engine's last word never came; its slots are "
                "released, as no write into them can come any more",
                fact.room,
            )
        return self._end(fact.room, None, None)

    def _end_reported(self, fact: EndReported) -> list[DecodeOutcome]:
        state = self._rooms.get(fact.note.room)
        if state is not None and self.link is not None and state.reported is None:
            state.reported = fact.note
            state.note_due_at = time.monotonic() + NOTE_GRACE_S
        return []

    def _peer_lost(self, fact: PeerLost) -> list[DecodeOutcome]:
        return [
            outcome
            for room in fact.rooms
            for outcome in self._end(room, fact.error, FailureReason.PEER_LOST)
        ]

    def _note(self, fact: NoteArrived) -> list[DecodeOutcome]:
        note = fact.note
        state = self._rooms.get(note.room)
        if state is None:
            return self._queued_note(note)
        state.notes[fact.rank] = note
        failed_now = state.waiting and note.status is not RoomStatus.DONE
        if failed_now:
            state.waiting = False
        complete = len(state.notes) == self.consensus.tp_size  # every rank's last word is in
        if complete:
            self._forget(note.room)
            if state.waiting:  # every rank's shard is here
                return [
                    DecodeOutcome(
                        note.room, note=state.notes[0], waited=time.monotonic() - state.asked_at
                    )
                ]
        if failed_now:
            return [_failed(note, released=complete)]
        return [DecodeOutcome(note.room, released=True)] if complete else []

    def _queued_note(self, note: RoomNote) -> list[DecodeOutcome]:
        """The prefill engine ended a room whose request is still queued here (it refused
        the request, its client left): the request fails now. No slots were posted, so no
        write can come; a DONE note, which needs them, is not its prefill engine's."""
        if note.status is RoomStatus.DONE or self._queued.pop(note.room, None) is None:
            return []  # a room that ended here already (failed, or its prefill engine dead)
        return [_failed(note, released=True)]

    def _note_overdue(self, fact: NoteOverdue) -> list[DecodeOutcome]:
        """The prefill engine's report ends the room, as its note would have, but a room it
        wrote fails: the note carries the first token."""
        note = fact.note
        if note.room not in self._rooms:
            return []  # its notes came in the same turn
        logger.warning(
            "room %d: the prefill engine ended it (%s) but its NIXL note did not arrive within "
            "%g s of saying so over HTTP",
            note.room,
            note.status,
            NOTE_GRACE_S,
        )
        if note.status is RoomStatus.DONE:
            error = (
                f"the prefill engine wrote the KV of room {note.room} but its note (with the "
                "first token) did not arrive"
            )
            return self._end(note.room, error, FailureReason.TRANSFER)
        error = note.error or f"the prefill engine ended room {note.room} ({note.status})"
        return self._end(note.room, error, note.reason or FailureReason.REFUSED, note.http_status)

    def _end(
        self,
        room: int,
        error: str | None,
        reason: FailureReason | None,
        http_status: int | None = None,
    ) -> list[DecodeOutcome]:
        """No write into the room's slots can come any more."""
        state = self._rooms.get(room)
        if state is None:
            return []
        self._forget(room)
        if state.waiting and error is not None:
            return [
                DecodeOutcome(
                    room, error=error, reason=reason, http_status=http_status, released=True
                )
            ]
        return [DecodeOutcome(room, released=True)]

    def _forget(self, room: int) -> None:
        state = self._rooms.pop(room)
        if self.link is not None:
            self.link.send(ForgetRoom(room, state.target.address))

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.agent.close()


# How each fact changes the rooms: every member of DecodeFact has its handler.
_HANDLERS: dict[type, Callable[[DecodeTransfers, Any], list[DecodeOutcome]]] = {
    NoteArrived: DecodeTransfers._note,
    KVTimedOut: DecodeTransfers._timed_out,
    LastWordOverdue: DecodeTransfers._last_word_overdue,
    NoteOverdue: DecodeTransfers._note_overdue,
    PostFailed: DecodeTransfers._post_failed,
    CancelUnknown: DecodeTransfers._cancel_unknown,
    CancelConfirmed: DecodeTransfers._cancel_confirmed,
    EndReported: DecodeTransfers._end_reported,
    PeerLost: DecodeTransfers._peer_lost,
}
assert set(_HANDLERS) == set(get_args(DecodeFact))


def _failed(note: RoomNote, released: bool) -> DecodeOutcome:
    """The request of a room its prefill engine failed, answered with that engine's error."""
    return DecodeOutcome(
        note.room,
        error=note.error,
        reason=note.reason or FailureReason.REFUSED,
        http_status=note.http_status,
        released=released,
    )


def _note_or_none(message: bytes) -> RoomNote | None:
    """A NIXL notification's note; None (and a warning) for anything else: any agent this one
    registered with may notify it."""
    try:
        return RoomNote.decode(message)
    except ValueError as exc:
        logger.warning("dropped a notification that is no room note (%s): %.100r", exc, message)
        return None
