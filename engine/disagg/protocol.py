"""What a prefill and a decode engine tell each other (docs/disaggregation.md), and what the
scheduler and the engine's bootstrap process tell each other about it.

A request carries its pairing as the router gave it (`BootstrapTarget`, engine/messages.py). The prefill engine
tells the decode engine how each room ended with a `RoomNote`: the notification of the KV
WRITE when it succeeded (with the first token), a plain notification when it did not. The
HTTP side of the handshake runs in the engine's bootstrap process (bootstrap.py): the
scheduler sends it `BootstrapRequest`s and hears back `BootstrapFact`s.

No heavy imports here: every process of an engine loads this module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import TypeVar

from kubesgl.contract import KV_LAYOUT_SCHEME, MAX_BOOTSTRAP_ROOM

T = TypeVar("T")


class FailureReason(StrEnum):
    """Why a room failed (the label of kubesgl_disagg_failures_total)."""

    REFUSED = "refused"  # the other engine rejected the request or the room
    TIMEOUT = "timeout"  # the partner did not act within --disaggregation-timeout
    TRANSFER = "transfer"  # the KV write itself failed, or its note never reached the decode side
    PEER_LOST = "peer_lost"  # the other engine died or restarted
    ABORTED = "aborted"  # the client left, or the engine shut down


class RoomStatus(StrEnum):
    DONE = "done"  # the KV of every layer is written; the first token rides along
    FAILED = "failed"  # the prefill side gave up on the room; no write is coming
    CANCELLED = "cancelled"  # the decode side cancelled it before any write started


@dataclass(frozen=True)
class RoomNote:
    """The last word of the prefill engine on a room. After it, no write into the room's
    destination slots can come, so the decode engine may reuse them."""

    room: int
    status: RoomStatus
    first_token: int | None = None
    logprob: float | None = None  # of the first token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the prefill engine found in its prefix cache
    error: str | None = None
    reason: FailureReason | None = None
    http_status: int | None = None  # the HTTP status the prefill engine refused the request with

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> RoomNote:
        """Raises ValueError for anything but a note `encode` made (any NIXL peer may notify)."""
        try:
            body = json.loads(data)
            note = cls(
                **{
                    **body,
                    "status": RoomStatus(body["status"]),
                    "top_logprobs": [(int(i), float(p)) for i, p in body["top_logprobs"]],
                    "reason": FailureReason(body["reason"]) if body["reason"] else None,
                }
            )
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a room note: {exc}") from None
        if not isinstance(note.room, int) or (
            note.status is RoomStatus.DONE and not isinstance(note.first_token, int)
        ):
            raise ValueError("not a room note: a room number, and a DONE note's first token")
        return note

    def outcome(self) -> dict:
        """How the room ended, the first token left out: what a prefill engine's bootstrap
        server tells the decode engine that asks (POST /kv/rooms/ended)."""
        return {
            "room": self.room,
            "status": self.status.value,
            "error": self.error,
            "reason": self.reason.value if self.reason else None,
            "http_status": self.http_status,
        }

    @classmethod
    def from_outcome(cls, body: dict) -> RoomNote:
        """Raises ValueError for anything but what `outcome` made."""
        try:
            room, error, status = body["room"], body["error"], body["http_status"]
            note = cls(
                room,
                RoomStatus(body["status"]),
                error=error,
                reason=FailureReason(body["reason"]) if body["reason"] else None,
                http_status=status,
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(f"not a room's outcome: {exc}") from None
        if not (
            isinstance(room, int)
            and not isinstance(room, bool)
            and isinstance(error, str | None)
            and isinstance(status, int | None)
        ):
            raise ValueError(f"not a room's outcome: {body!r:.200}")
        return note


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool's buffers are, as its peer must know to write into them."""

    agent: str
    memory: str  # "DRAM" | "VRAM"
    device_id: int
    slot_bytes: int  # one slot of one layer's K (or V) buffer
    slot_shape: tuple[int, ...]  # of one slot: KV heads, head dim
    dtype: str  # the KV cache's element type: equal bytes of another type would be garbage
    num_slots: int
    k_addresses: tuple[int, ...]  # each layer's K buffer
    v_addresses: tuple[int, ...]

    @classmethod
    def from_json(cls, value: object, name: str) -> PoolLayout:
        """The layout a peer sent (`asdict` of its own) as field `name` of its request's body.
        A field this version does not know is refused: the peer's pool may differ by it."""
        body = _checked(value, name, dict)
        if unknown := body.keys() - {f.name for f in fields(cls)}:
            raise ValueError(f"field {name!r} has fields no pool layout has: {sorted(unknown)}")
        integers = _list_of(_integer)
        return cls(
            _field(body, "agent", _string, name),
            _field(body, "memory", _string, name),
            _field(body, "device_id", _integer, name),
            _field(body, "slot_bytes", _integer, name),
            _field(body, "slot_shape", integers, name),
            _field(body, "dtype", _string, name),
            _field(body, "num_slots", _integer, name),
            _field(body, "k_addresses", integers, name),
            _field(body, "v_addresses", integers, name),
        )

    def compared(self) -> tuple[int, int, tuple[int, ...], str, int]:
        """What a peer's pool must have alike (check_compatible): the layers of K and of V,
        a slot's shape, the element type and a slot's bytes. Not where the buffers are, how
        many slots they hold or in which memory: those may differ."""
        return (
            len(self.k_addresses),
            len(self.v_addresses),
            tuple(self.slot_shape),
            self.dtype,
            self.slot_bytes,
        )

    def fingerprint(self, tp_size: int) -> str:
        """A short name of what `check_compatible` compares, and the tensor-parallel size (the
        bootstrap server's other check): engines whose fingerprints are equal pair up. The
        router learns a prefill or decode engine's from its /health answer
        (contract.KV_LAYOUT_HEADER) and pairs a decode worker only with prefill workers of
        its fingerprint (docs/disaggregation.md, Rollouts). Opaque: the router compares, never
        reads, it; KV_LAYOUT_SCHEME names how it was made, so that another version's way is
        told apart from a different layout."""
        compared = json.dumps([tp_size, *self.compared()], separators=(",", ":"))
        return f"{KV_LAYOUT_SCHEME}-{hashlib.sha256(compared.encode()).hexdigest()[:16]}"

    def check_compatible(self, peer: PoolLayout) -> None:
        mine, theirs = self.compared(), peer.compared()
        if mine != theirs:
            raise ValueError(
                f"KV pools differ: {mine[0]} layers of slots {list(self.slot_shape)} {self.dtype} "
                f"here, {theirs[0]} of {list(peer.slot_shape)} {peer.dtype} at {peer.agent} (same "
                "model, dtype, KV cache dtype and tensor-parallel size are needed on both sides)"
            )


@dataclass(frozen=True)
class RankAgent:
    """What a prefill rank needs to write into one decode rank's pool."""

    metadata: bytes  # NIXL agent metadata
    layout: PoolLayout

    def to_json(self) -> dict:
        return {"metadata": base64.b64encode(self.metadata).decode(), "layout": asdict(self.layout)}

    @classmethod
    def from_json(cls, value: object, name: str) -> RankAgent:
        """`name`: where the rank is in its request's body (ranks[1]), for the errors."""
        rank = _checked(value, name, dict)
        return cls(
            _field(rank, "metadata", _base64, name),
            _field(rank, "layout", PoolLayout.from_json, name),
        )


# -- bodies of the bootstrap server's requests (decode engine -> prefill engine, JSON) -------
# Their field names and JSON are the wire format: engines of this version and the previous one
# pair up in a rolling upgrade. Each `from_json` takes a JSON object and raises ValueError
# naming the first field that is missing or not what it must be; fields it does not know, it
# leaves alone (a pool layout's excepted). A check takes a field's value and its name
# (ranks[0].layout) for the error.

# The `code` of a bootstrap server's 404 answers that the decode engine acts on
UNKNOWN_PEER = "unknown_peer"  # POST /kv/rooms from an engine this instance has not registered
UNKNOWN_ROOM = "unknown_room"  # DELETE /kv/rooms/{room} of a room never posted here

_KINDS: dict[type, str] = {
    str: "a string",
    bool: "true or false",
    int: "an integer",
    list: "a list",
    dict: "an object",
}


def _checked(value: object, name: str, kind: type[T]) -> T:
    """`value` if it is a `kind` (a bool is no integer)."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"field {name!r} must be {_KINDS[kind]}, got {value!r:.100}")


def _field(body: dict, key: str, check: Callable[[object, str], T], within: str = "") -> T:
    """`body[key]`, checked; `within`: where `body` is in its request's body."""
    name = f"{within}.{key}" if within else key
    if key not in body:
        raise ValueError(f"field {name!r} is missing")
    return check(body[key], name)


def _optional(body: dict, key: str, check: Callable[[object, str], T], default: T) -> T:
    return check(body[key], key) if key in body else default


def _list_of(item: Callable[[object, str], T]) -> Callable[[object, str], tuple[T, ...]]:
    def check(value: object, name: str) -> tuple[T, ...]:
        return tuple(item(v, f"{name}[{i}]") for i, v in enumerate(_checked(value, name, list)))

    return check


def _string(value: object, name: str) -> str:
    return _checked(value, name, str)


def _integer(value: object, name: str) -> int:
    return _checked(value, name, int)


def _flag(value: object, name: str) -> bool:
    return _checked(value, name, bool)


def _room(value: object, name: str) -> int:
    room = _integer(value, name)
    if not 0 <= room <= MAX_BOOTSTRAP_ROOM:
        raise ValueError(
            f"field {name!r} must be a room, an integer in [0, {MAX_BOOTSTRAP_ROOM}], got {room}"
        )
    return room


def _slot(value: object, name: str) -> int:
    slot = _integer(value, name)
    if slot < 0:
        raise ValueError(f"field {name!r} must be a slot number, got {slot}")
    return slot


def _base64(value: object, name: str) -> bytes:
    try:
        return base64.b64decode(_string(value, name))
    except binascii.Error as exc:
        raise ValueError(f"field {name!r} must be base64: {exc}") from None


def room_in_path(text: str) -> int:
    """The room of `DELETE /kv/rooms/{room}`."""
    try:
        room: int | None = int(text)
    except ValueError:
        room = None
    if room is None or not 0 <= room <= MAX_BOOTSTRAP_ROOM:
        raise ValueError(
            f"the room in the path must be an integer in [0, {MAX_BOOTSTRAP_ROOM}], got {text!r:.100}"
        )
    return room


@dataclass(frozen=True)
class PeerRegistration:
    """`PUT /kv/peers`: a decode engine's id, and its ranks' NIXL agents and pools in rank order."""

    engine: str
    ranks: tuple[RankAgent, ...]

    def to_json(self) -> dict:
        return {"engine": self.engine, "ranks": [rank.to_json() for rank in self.ranks]}

    @classmethod
    def from_json(cls, body: dict) -> PeerRegistration:
        return cls(
            _field(body, "engine", _string), _field(body, "ranks", _list_of(RankAgent.from_json))
        )


@dataclass(frozen=True)
class RoomPostBody:
    """`POST /kv/rooms`: a room, and where its prompt's KV goes in the decode engine's pool."""

    room: int
    engine: str
    slots: tuple[int, ...]

    def to_json(self) -> dict:
        return {"room": self.room, "engine": self.engine, "slots": list(self.slots)}

    @classmethod
    def from_json(cls, body: dict) -> RoomPostBody:
        return cls(
            _field(body, "room", _room),
            _field(body, "engine", _string),
            _field(body, "slots", _list_of(_slot)),
        )


@dataclass(frozen=True)
class RoomsBody:
    """`POST /kv/rooms/queued` (rooms the decode engine has queued) and `POST /kv/rooms/ended`
    (the rooms it asks about)."""

    engine: str
    rooms: tuple[int, ...]

    def to_json(self) -> dict:
        return {"engine": self.engine, "rooms": list(self.rooms)}

    @classmethod
    def from_json(cls, body: dict) -> RoomsBody:
        return cls(_field(body, "engine", _string), _field(body, "rooms", _list_of(_room)))


@dataclass(frozen=True)
class CancelBody:
    """`DELETE /kv/rooms/{room}`, from a decode engine or the router: why, and whether the
    decode engine's request was aborted (its client left). Either may be left out: an older
    decode engine sends no `aborted`."""

    reason: str = ""
    aborted: bool = False

    def to_json(self) -> dict:
        return {"reason": self.reason, "aborted": self.aborted}

    @classmethod
    def from_json(cls, body: dict) -> CancelBody:
        return cls(_optional(body, "reason", _string, ""), _optional(body, "aborted", _flag, False))


WireBody = PeerRegistration | RoomPostBody | RoomsBody | CancelBody


# -- scheduler -> bootstrap process --------------------------------------------------------


@dataclass(frozen=True)
class ServeBootstrap:
    """Prefill role: serve the bootstrap server for this engine's ranks."""

    layout: PoolLayout  # rank 0's (every rank's pool has its shape)
    tp_size: int
    host: str
    port: int
    # --disaggregation-timeout: a KV write that runs longer fails its request here (the write
    # itself runs to its end; decode engines learn it at registration), and a posted room
    # number stays taken twice as long
    timeout_s: float


@dataclass(frozen=True)
class ConnectBootstrap:
    """Decode role: talk to prefill engines on behalf of these ranks."""

    engine: str  # this decode engine's id, unique among the engines it talks to
    ranks: tuple[RankAgent, ...]
    heartbeat_s: float = 2.0  # how often a prefill engine with rooms here is checked
    dead_after_s: float = 10.0  # how long it may be silent before its rooms fail


@dataclass(frozen=True)
class PostRoom:
    room: int
    address: str  # the prefill engine's bootstrap server
    slots: tuple[int, ...]


@dataclass(frozen=True)
class CancelRoom:
    room: int
    address: str
    reason: str
    aborted: bool = False  # the room's request was aborted here (its client left)


@dataclass(frozen=True)
class ForgetRoom:
    room: int
    address: str


@dataclass(frozen=True)
class StillQueued:
    address: str
    rooms: tuple[int, ...]


@dataclass(frozen=True)
class RoomWriting:
    """Prefill role: a write into the room's slots is in flight on some rank, or no longer.
    A cancel's answer says so, and the decode engine keeps the slots while it is."""

    room: int
    writing: bool


@dataclass(frozen=True)
class PeerConnected:
    """Prefill role: how connecting every rank to a registered decode engine's NIXL agents
    went (`error`: why one rank could not, say no transport of UCX reaches it). The
    registration waits for it, so a decode engine that cannot be written to learns it there."""

    engine: str
    error: str | None = None


@dataclass(frozen=True)
class RoomEnded:
    """Prefill role: the room's last word went to decode engine `engine` (`note`, the first
    token left out): the bootstrap server tells that engine when it asks, should the note
    not arrive."""

    engine: str
    note: RoomNote


# After the first request (ServeBootstrap or ConnectBootstrap), which makes the bootstrap
# process a prefill engine's server or a decode engine's client, the requests for that side
ServerRequest = RoomWriting | PeerConnected | RoomEnded
ClientRequest = PostRoom | CancelRoom | ForgetRoom | StillQueued
BootstrapRequest = ServeBootstrap | ConnectBootstrap | ServerRequest | ClientRequest


# -- bootstrap process -> scheduler: what arrived at a prefill engine's bootstrap server ----


@dataclass(frozen=True)
class PeerRegistered:
    engine: str  # the decode engine's id
    ranks: tuple[RankAgent, ...]  # one per tensor-parallel rank, in rank order


@dataclass(frozen=True)
class RoomPosted:
    room: int
    engine: str
    slots: tuple[int, ...]  # where the prompt's KV goes in the decode engine's pool


@dataclass(frozen=True)
class RoomCancelled:
    room: int
    reason: str
    aborted: bool = False  # the decode engine's request was aborted (its client left)


@dataclass(frozen=True)
class PeerForgotten:
    """A decode engine the bootstrap server has not heard from for its idle limit: its
    registration is dropped (should it come back, it registers again)."""

    engine: str


@dataclass(frozen=True)
class RoomsQueued:
    """Rooms a live decode engine has queued but not admitted yet: not to be timed out, and
    told at once should they end here before they are posted."""

    engine: str
    rooms: tuple[int, ...]


# -- and what a decode engine's client learned ---------------------------------------------


@dataclass(frozen=True)
class PostFailed:
    """Posting the room failed. Either the prefill engine never took it, so no write into
    its slots can come: it said no (REFUSED), or it could not be reached (PEER_LOST: it died
    or was never there). Or (`maybe_taken`) the connection broke after the post was sent: it
    may have taken the room, and the slots wait for its last word, or for its death."""

    room: int
    error: str
    reason: FailureReason = FailureReason.REFUSED
    maybe_taken: bool = False
    http_status: int | None = None  # the prefill engine's, for a room it refused (409: in use)


@dataclass(frozen=True)
class CancelUnknown:
    """The prefill engine answered a cancel with "never posted here": no write can come."""

    room: int


@dataclass(frozen=True)
class CancelConfirmed:
    """The prefill engine took the cancel of a room it had and no write into the room's
    slots is in flight there: it starts none any more. Should its last word be lost, the
    slots may be used again `release_after_s` from now."""

    room: int
    release_after_s: float


@dataclass(frozen=True)
class EndReported:
    """The prefill engine says it ended the room as `note` says (without the first token):
    its last word, as its NIXL note would have brought it. No write into the room's slots
    can come any more."""

    note: RoomNote


@dataclass(frozen=True)
class PeerLost:
    """The prefill engine these rooms were posted to died or restarted: none of its writes
    can come."""

    rooms: tuple[int, ...]
    error: str


BootstrapFact = (
    PeerRegistered
    | PeerForgotten
    | RoomPosted
    | RoomCancelled
    | RoomsQueued
    | PostFailed
    | CancelUnknown
    | CancelConfirmed
    | EndReported
    | PeerLost
)

Emit = Callable[[BootstrapFact], None]  # how the bootstrap process's side hands a fact on
