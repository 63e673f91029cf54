"""A decode engine's side of the bootstrap handshake (docs/disaggregation.md): `BootstrapClient`
registers with each prefill engine it has rooms at (`PUT /kv/peers`: the NIXL agent metadata and
pool layout of each tensor-parallel rank), posts each request's room with the slots it
allocated for the prompt (`POST /kv/rooms`), says which rooms it still has queued
(`POST /kv/rooms/queued`), cancels rooms it gave up on (`DELETE /kv/rooms/{room}`) and watches
the prefill engine's `GET /health` while it has rooms there: a prefill engine that refuses
connections, stops answering for `dead_after_s`, or answers as a new instance (restarted),
fails those rooms; at each heartbeat it also asks which of its rooms there have ended
(`POST /kv/rooms/ended`), the prefill engine's last word should a room's NIXL note not
arrive. It runs in the engine's bootstrap process (bootstrap.py); what it learns goes to the
scheduler as a `BootstrapFact`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, get_args

import httpx

from kubesgl.engine.disagg.lanes import AddressLanes
from kubesgl.engine.disagg.protocol import (
    UNKNOWN_PEER,
    UNKNOWN_ROOM,
    BootstrapRequest,
    CancelBody,
    CancelConfirmed,
    CancelRoom,
    CancelUnknown,
    ClientRequest,
    ConnectBootstrap,
    Emit,
    EndReported,
    FailureReason,
    ForgetRoom,
    PeerLost,
    PeerRegistration,
    PostFailed,
    PostRoom,
    RoomNote,
    RoomPostBody,
    RoomsBody,
    StillQueued,
)

logger = logging.getLogger(__name__)

# Failures before a request left: the prefill engine cannot have seen it.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class _Dead(Exception):
    """A prefill engine that is gone, or silent for too long: none of its writes can come."""


@dataclass(frozen=True)
class _Registration:
    instance: str  # the prefill engine's: a new one means it restarted
    # its --disaggregation-timeout, after which a write fails its request (None: an engine
    # too old to say)
    timeout_s: float | None


@dataclass(eq=False)
class _Peer:
    """A prefill engine instance: the registrations with it, and the rooms posted there."""

    registration: Future[_Registration] | None = None  # the latest attempt
    known: _Registration | None = None  # the latest that succeeded
    rooms: dict[int, str] = field(default_factory=dict)  # each posted room: the instance it is at
    last_ok: float = field(default_factory=time.monotonic)


class BootstrapClient:
    """Decode side: all HTTP to prefill engines, on worker threads. What it learns, it emits."""

    def __init__(self, emit: Emit, connect: ConnectBootstrap):
        self.emit, self.engine, self.ranks = emit, connect.engine, connect.ranks
        self.heartbeat_s, self.dead_after_s = connect.heartbeat_s, connect.dead_after_s
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, connect=3.0))
        # Per prefill engine, a share of the threads: one that hangs (3 s to connect, 10 s
        # to answer) holds its share, not the posts to the others.
        self._workers = AddressLanes(workers=32, per_address=8, name="kubesgl-kv-rooms")
        # Registrations on threads of their own: posts wait for them, and on the posts' pool
        # a burst of posts could take every thread and leave the registration none. One at
        # a time per prefill engine is all there is (the latest, tried again if it failed).
        self._registrations = AddressLanes(workers=4, per_address=1, name="kubesgl-kv-register")
        # Heartbeat checks, all at once: one after another, each hung prefill engine would add
        # its timeout to the round, and the others' rooms would fail that much later.
        self._checks = AddressLanes(workers=32, per_address=1, name="kubesgl-kv-check")
        self._failing_checks: set[str] = set()  # addresses whose last check raised
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}  # prefill engine address -> its current registration
        self._posts: dict[int, Future] = {}
        # cancels of rooms whose write was in flight at the prefill engine: asked again at
        # the next heartbeat
        self._cancel_again: dict[int, CancelRoom] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="kubesgl-kv-heartbeat", daemon=True
        )
        self._watcher.start()

    def handle(self, request: BootstrapRequest) -> None:
        """What the scheduler asks the client to do (decode role)."""
        handler = _CLIENT_HANDLERS.get(type(request))
        if handler is None:  # the server's request, or a second first one
            raise TypeError(f"not a request for a BootstrapClient: {request!r}")
        handler(self, request)

    def post(self, post: PostRoom) -> None:
        self._posts[post.room] = self._workers.submit(
            post.address, self._post, post.room, post.address, list(post.slots)
        )

    def still_queued(self, queued: StillQueued) -> None:
        """Tell the prefill engine at its address that these rooms wait in this engine's queue."""
        self._workers.submit(queued.address, self._still_queued, queued.address, list(queued.rooms))

    def cancel(self, cancel: CancelRoom) -> None:
        """Cancel after the post has finished: a cancel overtaking its post would be lost.
        `cancel.aborted`: the room's request was aborted here (its client left)."""

        def send() -> None:
            self._workers.submit(cancel.address, self._cancel, cancel)

        post = self._posts.get(cancel.room)
        if post is None:
            send()
        else:  # chained, not waited for on a worker thread: the post may take seconds
            post.add_done_callback(lambda _: send())

    def forget(self, forget: ForgetRoom) -> None:
        """The room has ended on this side: stop watching its prefill engine for it."""
        self._posts.pop(forget.room, None)
        with self._lock:
            self._cancel_again.pop(forget.room, None)
            peer = self._peers.get(forget.address)
            if peer is not None:
                peer.rooms.pop(forget.room, None)

    # -- worker threads ----------------------------------------------------------------
    def _registered_peer(self, address: str) -> tuple[_Peer, Future[_Registration]]:
        """The prefill engine at `address`, once registered with (raises if that fails), and
        the registration used. A failed registration is tried again on the same peer: its
        rooms stay watched, at the instance last registered with."""
        with self._lock:
            peer = self._peers.setdefault(address, _Peer())
            if peer.registration is None or (
                peer.registration.done() and peer.registration.exception() is not None
            ):
                peer.registration = self._registrations.submit(
                    address, self._register, address, peer
                )
            used = peer.registration
        used.result()
        return peer, used

    def _forgot_us(
        self, address: str, peer: _Peer, used: Future[_Registration], answer: httpx.Response
    ) -> bool:
        """True if the prefill engine does not know this engine (it forgot an idle
        registration, or restarted): one registration again, for every request told so,
        which says which (`_register`)."""
        if answer.status_code != 404 or _code(answer) != UNKNOWN_PEER:
            return False
        with self._lock:
            if self._peers.get(address) is peer and peer.registration is used:
                peer.registration = self._registrations.submit(
                    address, self._register, address, peer
                )
        return True

    def _lost(self, address: str, peer: _Peer, error: str) -> None:
        """The engine `peer` registered with is gone: its rooms fail; the next post registers anew."""
        with self._lock:
            if self._peers.get(address) is not peer:
                return  # already noticed
            del self._peers[address]
            rooms = tuple(peer.rooms)
        self.emit(PeerLost(rooms, error))

    def _restarted(self, address: str, peer: _Peer, instance: str) -> None:
        """The prefill engine at `address` is `instance` now: rooms at any other are lost.
        (A post sent under the old registration may have reached the new instance: each room
        is judged by the instance that took it.)"""
        with self._lock:
            lost = tuple(room for room, at in peer.rooms.items() if at != instance)
            for room in lost:
                del peer.rooms[room]
        if lost:
            self.emit(PeerLost(lost, f"the prefill engine at {address} restarted"))

    def _register(self, address: str, peer: _Peer) -> _Registration:
        registering = PeerRegistration(self.engine, self.ranks)
        answer = self._http.put(f"{address}/kv/peers", json=registering.to_json())
        _raise_for_status(answer)
        body = answer.json()
        timeout_s = body.get("timeout_s")
        registration = _Registration(
            str(body["instance"]), float(timeout_s) if timeout_s is not None else None
        )
        with self._lock:
            peer.known = registration
        self._restarted(address, peer, registration.instance)
        return registration

    def _post(self, room: int, address: str, slots: list[int]) -> None:
        """A room joins its peer's watched rooms (those a lost peer fails) only once the
        peer may have it: a post still under way is no room of an instance that went."""
        body = RoomPostBody(room, self.engine, tuple(slots)).to_json()
        peer: _Peer | None = None
        sent = False  # this attempt's post left: a broken connection may hide a taken room
        try:
            for attempt in range(2):
                sent = False
                peer, used = self._registered_peer(address)  # its failure: not posted
                sent = True
                answer = self._http.post(f"{address}/kv/rooms", json=body)
                if attempt == 0 and self._forgot_us(address, peer, used, answer):
                    continue
                _raise_for_status(answer)
                taken_by = answer.json().get("instance") or used.result().instance
                self._watch_room(peer, room, taken_by)
                return
        except httpx.TransportError as exc:
            maybe_taken = sent and not isinstance(exc, _NOT_SENT)
            if maybe_taken and peer is not None:  # its death, at least, must free the slots
                self._watch_room(peer, room, used.result().instance)
            self.emit(
                PostFailed(
                    room,
                    f"the prefill engine at {address} could not be reached for room {room}: "
                    f"{_why(exc)}",
                    FailureReason.PEER_LOST,
                    maybe_taken=maybe_taken,
                )
            )
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure means the room was not taken
            status = exc.status if isinstance(exc, Refused) and exc.status == 409 else None
            self.emit(
                PostFailed(
                    room,
                    f"the prefill engine at {address} refused room {room}: {_why(exc)}",
                    http_status=status,
                )
            )
            raise

    def _watch_room(self, peer: _Peer, room: int, instance: str) -> None:
        with self._lock:
            if not peer.rooms:  # watched from now: silence before this is no silence of ours
                peer.last_ok = time.monotonic()
            peer.rooms[room] = instance

    def _still_queued(self, address: str, rooms: list[int]) -> None:
        body = RoomsBody(self.engine, tuple(rooms)).to_json()
        try:
            for attempt in range(2):
                peer, used = self._registered_peer(address)  # only a registered engine may say
                answer = self._http.post(f"{address}/kv/rooms/queued", json=body)
                if attempt == 0 and self._forgot_us(address, peer, used, answer):
                    continue
                _raise_for_status(answer)
                return
        except Exception as exc:  # noqa: BLE001 - at worst the prefill engine times the rooms out
            logger.warning(
                "telling %s about %d queued rooms failed: %s", address, len(rooms), _why(exc)
            )

    def _cancel(self, cancel: CancelRoom) -> None:
        room, address = cancel.room, cancel.address
        try:
            answer = self._http.request(
                "DELETE",
                f"{address}/kv/rooms/{room}",
                json=CancelBody(cancel.reason, cancel.aborted).to_json(),
            )
            if answer.status_code == 404 and _code(answer) == UNKNOWN_ROOM:
                self.emit(CancelUnknown(room))
            elif answer.status_code == 200 and answer.json().get("write_in_flight"):
                # the slots stay held: the write's end brings the last word; should that be
                # lost, the next heartbeat asks again
                self._ask_again(cancel)
            elif answer.status_code == 200 and (timeout_s := self._write_timeout(address)):
                # no write in flight: twice its timeout covers a last word that is lost
                self.emit(CancelConfirmed(room, release_after_s=2 * timeout_s))
        except httpx.HTTPError as exc:
            if _nothing_listens(exc):  # no write can come from there
                error = _gone(address, exc)
                logger.warning("room %d not cancelled: %s", room, error)
                self.emit(PeerLost((room,), error))  # its slots here, if any, are free
                return
            logger.warning("cancelling room %d at %s failed: %s", room, address, _why(exc))
            self._ask_again(cancel)

    def _ask_again(self, cancel: CancelRoom) -> None:
        """Cancel the room again at the next heartbeat, while it is watched: a room no longer
        watched has ended here (its engine found dead, its last word come), or never held
        slots here (refused before its post: its prefill engine times it out)."""
        with self._lock:
            peer = self._peers.get(cancel.address)
            if peer is not None and cancel.room in peer.rooms:
                self._cancel_again[cancel.room] = cancel

    def _write_timeout(self, address: str) -> float | None:
        with self._lock:
            peer = self._peers.get(address)
            return peer.known.timeout_s if peer is not None and peer.known is not None else None

    def _watch(self) -> None:
        """Heartbeat: every prefill engine with rooms answers /health, or its rooms fail
        (within about `dead_after_s`); rooms at an instance other than the one answering fail."""
        checks: dict[str, Future[None]] = {}
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                watched = [(a, p) for a, p in self._peers.items() if p.rooms]
                cancel_again, self._cancel_again = self._cancel_again, {}
            for cancel in cancel_again.values():
                self._workers.submit(cancel.address, self._cancel, cancel)
            for address, peer in watched:
                if address not in checks or checks[address].done():  # else its last still runs
                    checks[address] = self._checks.submit(address, self._check, address, peer)
                    checks[address].add_done_callback(partial(self._checked, address))
            checks = {address: check for address, check in checks.items() if not check.done()}

    def _checked(self, address: str, check: Future[None]) -> None:
        """A heartbeat check ended. One that raised, which no one else reads, is logged at
        ERROR once until a check of that engine passes (after, at DEBUG: it would repeat every
        beat); its rooms wait for the next."""
        if check.cancelled():
            return
        if (exc := check.exception()) is None:
            self._failing_checks.discard(address)
            return
        level = logging.DEBUG if address in self._failing_checks else logging.ERROR
        self._failing_checks.add(address)
        logger.log(
            level, "the heartbeat check of the prefill engine at %s failed", address, exc_info=exc
        )

    def _check(self, address: str, peer: _Peer) -> None:
        """One heartbeat of one prefill engine, bounded by its requests' timeouts."""
        try:
            instance = self._instance(address, peer)
        except _Dead as dead:
            self._lost(address, peer, str(dead))
            return
        if instance is not None:
            self._restarted(address, peer, instance)
            self._ask_ended(address, peer)

    def _instance(self, address: str, peer: _Peer) -> str | None:
        """The instance answering at `address`; None while it is slow or confused, until it
        has been silent for `dead_after_s` (then _Dead, as when nothing listens there)."""
        try:
            answer = self._http.get(f"{address}/health", timeout=min(self.heartbeat_s, 3.0))
            answer.raise_for_status()
            instance = str(answer.json()["instance"])
        except Exception as exc:  # noqa: BLE001 - slow, confused, unreachable: until dead_after_s
            if _nothing_listens(exc):  # gone, its rooms with it
                raise _Dead(_gone(address, exc)) from exc
            silent = time.monotonic() - peer.last_ok
            if silent > self.dead_after_s:
                raise _Dead(
                    f"the prefill engine at {address} has not answered for {silent:.0f} s "
                    f"({_why(exc)})"
                ) from exc
            return None
        peer.last_ok = time.monotonic()
        return instance

    def _ask_ended(self, address: str, peer: _Peer) -> None:
        """Which of this engine's rooms at `address` the prefill engine has ended, and how:
        its last word, should a room's NIXL note not arrive (the scheduler gives the note a
        grace first). After `_instance`: the rooms left are at the instance that answers."""
        with self._lock:
            rooms = list(peer.rooms)
        if not rooms:
            return
        try:
            answer = self._http.post(
                f"{address}/kv/rooms/ended",
                json=RoomsBody(self.engine, tuple(rooms)).to_json(),
                timeout=min(self.heartbeat_s, 3.0),
            )
            _raise_for_status(answer)
            notes = [RoomNote.from_outcome(outcome) for outcome in answer.json()["ended"]]
        except Exception as exc:  # noqa: BLE001 - an older prefill engine (404), a slow one: the notes or the timeout end the rooms
            logger.debug("asking %s which rooms ended failed: %s", address, _why(exc))
            return
        for note in notes:
            self.emit(EndReported(note))

    def close(self) -> None:
        self._stop.set()
        self._workers.close()
        self._registrations.close()
        self._checks.close()
        self._http.close()


# What the scheduler asks a decode engine's bootstrap client to do: every member of
# ClientRequest has its handler.
_CLIENT_HANDLERS: dict[type, Callable[[BootstrapClient, Any], None]] = {
    PostRoom: BootstrapClient.post,
    CancelRoom: BootstrapClient.cancel,
    ForgetRoom: BootstrapClient.forget,
    StillQueued: BootstrapClient.still_queued,
}
assert set(_CLIENT_HANDLERS) == set(get_args(ClientRequest))


def _code(answer: httpx.Response) -> str | None:
    try:
        return answer.json().get("code")
    except ValueError:
        return None


class Refused(RuntimeError):
    """A prefill engine's error answer."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _raise_for_status(answer: httpx.Response) -> None:
    if answer.status_code >= 400:
        try:
            message = answer.json()["error"]
        except (ValueError, KeyError):
            message = f"HTTP {answer.status_code}"
        raise Refused(message, answer.status_code)


def _why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"


def _nothing_listens(exc: BaseException) -> bool:
    """The connection was refused: no process listens there, so none writes from there. Other
    failures to connect (no route, a name that does not resolve, no file descriptor left here)
    leave the engine maybe alive: its silence must last `dead_after_s` first."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return True
        if isinstance(cause, BaseExceptionGroup):  # every address of a name, tried: all refused
            return all(_nothing_listens(member) for member in cause.exceptions)
        cause = cause.__cause__ or cause.__context__
    return False


def _gone(address: str, exc: BaseException) -> str:
    """Why a prefill engine counts as dead: nothing listens at its bootstrap address."""
    return f"the prefill engine at {address} is gone ({_why(exc)})"
