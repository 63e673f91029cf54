"""The bootstrap handshake over HTTP (docs/disaggregation.md, the bootstrap server), in a process
of its own beside the engine's schedulers (`run_bootstrap`), so that no network I/O waits on
a scheduler busy with steps (it holds the GIL for most of every step).

A prefill engine serves `BootstrapServer` on `--disaggregation-bootstrap-port`. A decode
engine (`BootstrapClient`) registers there once (`PUT /kv/peers`: the NIXL agent metadata and
pool layout of each tensor-parallel rank), posts each request's room with the slots it
allocated for the prompt (`POST /kv/rooms`), says which rooms it still has queued
(`POST /kv/rooms/queued`), cancels rooms it gave up on (`DELETE /kv/rooms/{room}`) and watches
the prefill engine's `GET /health` while it has rooms there: a prefill engine that refuses
connections, stops answering for `dead_after_s`, or answers as a new instance (restarted),
fails those rooms; at each heartbeat it also asks which of its rooms there have ended
(`POST /kv/rooms/ended`), the prefill engine's last word should a room's NIXL note not
arrive. What either side learns goes to the scheduler as a `BootstrapFact`.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar, get_args

import httpx
import zmq

from kubesgl.engine.child_process import exit_with_parent
from kubesgl.engine.disagg.lanes import AddressLanes
from kubesgl.engine.disagg.protocol import (
    BootstrapFact,
    BootstrapRequest,
    CancelBody,
    CancelConfirmed,
    CancelRoom,
    CancelUnknown,
    ClientRequest,
    ConnectBootstrap,
    EndReported,
    FailureReason,
    ForgetRoom,
    PeerConnected,
    PeerForgotten,
    PeerLost,
    PeerRegistered,
    PeerRegistration,
    PostFailed,
    PostRoom,
    RoomCancelled,
    RoomEnded,
    RoomNote,
    RoomPostBody,
    RoomPosted,
    RoomsBody,
    RoomsQueued,
    RoomWriting,
    ServeBootstrap,
    ServerRequest,
    StillQueued,
    WireBody,
    room_in_path,
)
from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import Shutdown

logger = logging.getLogger(__name__)

Emit = Callable[[BootstrapFact], None]
Answer = tuple[int, dict]  # an HTTP status and its JSON body

UNKNOWN_PEER = "unknown_peer"  # POST /kv/rooms from an engine this instance has not registered
UNKNOWN_ROOM = "unknown_room"  # DELETE /kv/rooms/{room} of a room never posted here
_MAX_BODY_BYTES = 64 << 20  # a registration of many ranks, or a room of a very long prompt
# A decode engine silent this long (no registration, post or queued rooms) is forgotten: pods
# come and go, and each registration holds a NIXL connection per rank. One that was only
# idle registers again with its next post.
PEER_IDLE_S = 600.0
_SWEEP_EVERY_S = 60.0
# How long a registration waits for the scheduler to connect to the decode engine's NIXL
# agents. A scheduler busy with a long step answers later: the registration is then taken
# as it is, and a failure to connect drops it afterwards (the next post registers again).
CONNECT_WAIT_S = 5.0
# A decode engine the scheduler could not connect to is not tried again at each of its
# registrations (one per request it gets, each an add_remote_agent on every rank's scheduler
# thread): they are refused with the error for this long, doubled after each failure up to
# the cap. One that comes back with other agents (restarted) is tried at once.
CONNECT_RETRY_FIRST_S = 2.0
CONNECT_RETRY_MAX_S = 60.0


@dataclass
class _Unreachable:
    """A decode engine whose agents (`metadata`, per rank) could not be connected to."""

    metadata: tuple[bytes, ...]
    error: str
    wait_s: float  # from the last failure to the next try
    retry_at: float


@dataclass(frozen=True)
class _EndedRoom:
    """A room's last word, as it went out to its decode engine."""

    engine: str
    note: RoomNote
    at: float  # time.monotonic() when it went


class BootstrapServer:
    """HTTP endpoint of a prefill engine for the decode engines; what arrives, it emits."""

    def __init__(self, emit: Emit, serve: ServeBootstrap):
        self.emit, self.layout, self.tp_size = emit, serve.layout, serve.tp_size
        self.timeout_s = timeout_s = serve.timeout_s  # the engine's --disaggregation-timeout
        self.instance = uuid.uuid4().hex  # a restarted engine is a new instance
        self._room_memory_s = 2 * timeout_s  # no request for a room comes after this
        self._writing: set[int] = set()  # rooms with a write in flight (RoomWriting)
        self._settled: set[int] = set()  # posted rooms no write runs into, nor will
        self._cancelled: set[int] = set()  # posted rooms whose cancel the scheduler was sent
        self._lock = threading.Lock()
        self._engines: dict[str, int] = {}  # registered decode engines: their pools' slots
        self._heard_at: dict[str, float] = {}  # when each last registered, posted or queued
        # registrations waiting for the scheduler's PeerConnected (the error, or None); two
        # of one engine may overlap, and both take the answer
        self._connecting: dict[str, list[Future[str | None]]] = {}
        self._trying: dict[str, tuple[bytes, ...]] = {}  # the agents the latest one is for
        self._unreachable: dict[str, _Unreachable] = {}  # decode engines refused for a while
        self._retry_first_s, self._retry_max_s = CONNECT_RETRY_FIRST_S, CONNECT_RETRY_MAX_S
        self._peer_idle_s = PEER_IDLE_S
        self._next_sweep = 0.0
        self._rooms: dict[int, float] = {}  # posted rooms, until forgotten: a duplicate is a 409
        # rooms whose last word went out, oldest first, for as long as posted rooms are
        # remembered: a note NIXL does not deliver leaves the decode engine waiting, which
        # asks (POST /kv/rooms/ended)
        self._ended: dict[int, _EndedRoom] = {}
        self._http = _BootstrapHTTPServer((serve.host, serve.port), self._handler())
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="kubesgl-bootstrap", daemon=True
        )
        self._thread.start()

    # Each method answers (status, body); the handler does the HTTP. Facts are emitted with
    # the lock held, so they reach the scheduler in the order the lock saw them.
    def health(self) -> Answer:
        return 200, {"instance": self.instance, "tp_size": self.tp_size}

    def sweep_idle_peers(self) -> None:
        """What every request runs (decode engines with rooms here ask for /health every few
        seconds): `forget_idle_peers`, at most once a minute, off the path of most posts."""
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY_S
            self.forget_idle_peers()

    def forget_idle_peers(self) -> None:
        """Drops the registrations of decode engines silent for the idle limit, and the
        back-off of those that have not tried again for as long."""
        now = time.monotonic()
        with self._lock:
            for engine, heard_at in list(self._heard_at.items()):
                if now - heard_at > self._peer_idle_s:
                    del self._heard_at[engine], self._engines[engine]
                    self.emit(PeerForgotten(engine))
            for engine, unreachable in list(self._unreachable.items()):
                if now - unreachable.retry_at > self._peer_idle_s:
                    del self._unreachable[engine]

    def register(self, registration: PeerRegistration) -> Answer:
        ranks = registration.ranks
        if len(ranks) != self.tp_size:
            return 400, {
                "error": f"the decode engine has tensor-parallel size {len(ranks)}, this prefill engine "
                f"{self.tp_size}: they must be equal"
            }
        for rank in ranks:
            self.layout.check_compatible(rank.layout)
        engine, metadata = registration.engine, tuple(rank.metadata for rank in ranks)
        connected: Future[str | None] = Future()
        with self._lock:
            unreachable = self._unreachable.get(engine)
            now = time.monotonic()
            if unreachable and unreachable.metadata == metadata and now < unreachable.retry_at:
                return 502, {
                    "error": f"this prefill engine cannot reach decode engine {engine} over NIXL: "
                    f"{unreachable.error} (tried again in {unreachable.retry_at - now:.1f} s)"
                }
            self._trying[engine] = metadata
            self._engines[engine] = min(rank.layout.num_slots for rank in ranks)
            self._heard_at[engine] = now
            self._connecting.setdefault(engine, []).append(connected)
            self.emit(PeerRegistered(engine, ranks))
        try:
            error = connected.result(timeout=CONNECT_WAIT_S)
        except TimeoutError:
            error = None
        if error is not None:
            return 502, {
                "error": f"this prefill engine cannot reach decode engine {engine} over NIXL: {error}"
            }
        return 200, {"instance": self.instance, "timeout_s": self.timeout_s}

    def handle(self, request: BootstrapRequest) -> None:
        """What the scheduler tells the server (prefill role)."""
        _handle(_SERVER_HANDLERS, self, request)

    def peer_connected(self, outcome: PeerConnected) -> None:
        """The scheduler connected to a registered decode engine, or could not: then the
        registration goes, so that no room is taken for an engine no write can reach."""
        engine, error = outcome.engine, outcome.error
        with self._lock:
            waiting = self._connecting.pop(engine, [])
            metadata = self._trying.pop(engine, None)
            if error is None:
                self._unreachable.pop(engine, None)
            else:
                self._engines.pop(engine, None)
                self._heard_at.pop(engine, None)
                if metadata is not None:  # not the answer to an overlapping registration's try
                    self._back_off(engine, metadata, error)
        for connected in waiting:
            connected.set_result(error)

    def _back_off(self, engine: str, metadata: tuple[bytes, ...], error: str) -> None:
        """Refuse the engine's registrations with the same agents for a while: longer than
        the last time if that failed too."""
        last = self._unreachable.get(engine)
        wait_s = (
            min(2 * last.wait_s, self._retry_max_s)
            if last is not None and last.metadata == metadata
            else self._retry_first_s
        )
        self._unreachable[engine] = _Unreachable(metadata, error, wait_s, time.monotonic() + wait_s)

    def post_room(self, post: RoomPostBody) -> Answer:
        room, engine, slots = post.room, post.engine, post.slots
        with self._lock:
            # under the lock: rooms are remembered in the order of their times (expiry)
            now = time.monotonic()
            num_slots = self._engines.get(engine)
            if num_slots is None:
                return 404, {
                    "error": f"decode engine {engine} is not registered with this prefill engine",
                    "code": UNKNOWN_PEER,
                }
            if any(slot >= num_slots for slot in slots):
                raise ValueError(f"slots must be slot numbers of the decode engine's {num_slots}")
            self._forget_old_rooms(now)
            if room in self._rooms:
                return 409, {"error": f"room {room} is already in use"}
            self._rooms[room] = self._heard_at[engine] = now
            self.emit(RoomPosted(room, engine, slots))
        return 200, {"instance": self.instance}  # the one that took it

    def _forget_old_rooms(self, now: float) -> None:
        """Oldest first, up to the first room still remembered: a post costs what expires,
        not what is remembered (thousands of rooms at a few hundred posts a second)."""
        while self._rooms:
            oldest, posted_at = next(iter(self._rooms.items()))
            if now - posted_at < self._room_memory_s:
                break
            del self._rooms[oldest]
            self._settled.discard(oldest)
            self._cancelled.discard(oldest)

    def rooms_queued(self, queued: RoomsBody) -> Answer:
        engine, rooms = queued.engine, queued.rooms
        with self._lock:
            if engine not in self._engines:  # only a registered one may keep rooms waiting
                return 404, {
                    "error": "not registered with this prefill engine",
                    "code": UNKNOWN_PEER,
                }
            self._heard_at[engine] = time.monotonic()
            self.emit(RoomsQueued(engine, rooms))
        return 200, {}

    def room_ended(self, ended: RoomEnded) -> None:
        note, now = ended.note, time.monotonic()
        with self._lock:
            while self._ended:
                oldest, last_word = next(iter(self._ended.items()))
                if now - last_word.at < self._room_memory_s:
                    break
                del self._ended[oldest]
            self._ended.pop(note.room, None)  # kept in the order of their ends
            self._ended[note.room] = _EndedRoom(ended.engine, note, now)

    def rooms_ended(self, asked: RoomsBody) -> Answer:
        """Which of the rooms a decode engine asks about this instance has ended for it, and
        how (the first token left out: a DONE room whose note did not arrive fails there)."""
        engine = asked.engine
        with self._lock:
            ended = [self._ended.get(room) for room in asked.rooms]
        return 200, {"ended": [e.note.outcome() for e in filter(None, ended) if e.engine == engine]}

    def room_writing(self, write: RoomWriting) -> None:
        with self._lock:
            if write.writing:
                self._writing.add(write.room)
            else:  # the write ended, or the scheduler took a cancel: no write runs nor will
                self._writing.discard(write.room)
                # only a remembered room: the rooms' expiry is what forgets it again (a room
                # cancelled before its post is settled by no post)
                if write.room in self._rooms:
                    self._settled.add(write.room)

    def cancel_room(self, room: int, cancel: CancelBody) -> Answer:
        """Cancelled whether posted or not (its request may be running, or still to come);
        the answer tells the decode engine whether a write into its slots can be under way.
        A posted room counts as written to until the scheduler, having taken the cancel, says
        no write runs (RoomWriting): one may start before the cancel reaches it, and a write
        runs to its end (NIXL cannot call it back). The decode engine asks again until then;
        the scheduler hears of a posted room's cancel once, however often it is asked."""
        with self._lock:
            posted = room in self._rooms
            in_flight = room in self._writing or (posted and room not in self._settled)
            if room not in self._cancelled:
                self.emit(RoomCancelled(room, cancel.reason, cancel.aborted))
            if posted:
                self._cancelled.add(room)
        if not posted and not in_flight:
            return 404, {"error": f"room {room} was never posted here", "code": UNKNOWN_ROOM}
        return 200, {"write_in_flight": in_flight}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            # No Nagle delay between a response's headers and its body: a room's post is on the
            # path of its request's first token. (One request per connection: a server that is
            # closed must stop answering at once, heartbeats on open connections included.)
            disable_nagle_algorithm = True
            timeout = 30  # seconds a connection may sit idle or send slowly: threads are not free

            def handle_one_request(self) -> None:
                server.sweep_idle_peers()
                super().handle_one_request()

            def do_GET(self):  # noqa: N802 - http.server's naming
                self._answer("GET")

            def do_PUT(self):  # noqa: N802
                self._answer("PUT")

            def do_POST(self):  # noqa: N802
                self._answer("POST")

            def do_DELETE(self):  # noqa: N802
                self._answer("DELETE")

            def _answer(self, method: str) -> None:
                found = _route(method, self.path)
                if found is None:
                    return self._reply(404, {"error": f"no such path {self.path}"})
                route, room_text = found
                try:
                    answer = getattr(server, route.answer)
                    status, body = answer(*self._arguments(route, room_text))
                except (ValueError, RecursionError) as exc:
                    # a path or body unlike the route's (one nested too deep to read), slots
                    # off the pool
                    status, body = 400, {"error": f"{type(exc).__name__}: {exc}"}
                except (TimeoutError, ConnectionError):
                    # the peer stalled or left while it sent its body: as http.server does
                    # when reading a request fails, close without an answer or a log line
                    self.close_connection = True
                    return
                except Exception as exc:
                    # This server's fault: answered, or the caller would read a dropped
                    # connection as the prefill engine gone.
                    logger.exception("bootstrap server: %s %s failed", method, self.path)
                    status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
                self._reply(status, body)

            def _arguments(self, route: _Route, room_text: str | None) -> list:
                """The room in the path, if the route has one, then the body, if it takes one."""
                arguments: list = [] if room_text is None else [room_in_path(room_text)]
                if route.body is not None:
                    arguments.append(route.body.from_json(self._body()))
                return arguments

            def _body(self) -> dict:
                length = int(self.headers.get("content-length", 0))
                if not 0 <= length <= _MAX_BODY_BYTES:
                    raise ValueError(f"a body of {length} bytes")
                body = json.loads(self.rfile.read(length)) if length else {}
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                return body

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # it gave up waiting: no error here
                    self.close_connection = True

            def log_message(self, *args) -> None:  # the engine logs what matters
                pass

        return Handler

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


# What the scheduler tells a prefill engine's bootstrap server: every member of ServerRequest
# has its handler.
_SERVER_HANDLERS: dict[type, Callable[[BootstrapServer, Any], None]] = {
    RoomWriting: BootstrapServer.room_writing,
    PeerConnected: BootstrapServer.peer_connected,
    RoomEnded: BootstrapServer.room_ended,
}
assert set(_SERVER_HANDLERS) == set(get_args(ServerRequest))


@dataclass(frozen=True)
class _Route:
    body: type[WireBody] | None  # what the body must be (None: none is read)
    # the server's method that answers, given the room in the path (where the route has one),
    # then the body; named, so that it is looked up on the server (tests stand in for one)
    answer: str


_ROOM_IN_PATH = "{room}"  # at the end of a route's path: the rest of the request's path
# The bootstrap server's requests (docs/disaggregation.md): every body of WireBody is one's.
_ROUTES: dict[tuple[str, str], _Route] = {
    ("GET", "/health"): _Route(None, "health"),
    ("PUT", "/kv/peers"): _Route(PeerRegistration, "register"),
    ("POST", "/kv/rooms"): _Route(RoomPostBody, "post_room"),
    ("POST", "/kv/rooms/queued"): _Route(RoomsBody, "rooms_queued"),
    ("POST", "/kv/rooms/ended"): _Route(RoomsBody, "rooms_ended"),
    ("DELETE", "/kv/rooms/" + _ROOM_IN_PATH): _Route(CancelBody, "cancel_room"),
}
assert {route.body for route in _ROUTES.values()} - {None} == set(get_args(WireBody))
assert all(callable(getattr(BootstrapServer, route.answer, None)) for route in _ROUTES.values())


def _route(method: str, path: str) -> tuple[_Route, str | None] | None:
    """The route of a request, and the room in its path (its text) where the route has one."""
    if (route := _ROUTES.get((method, path))) is not None:
        return route, None
    for (route_method, pattern), route in _ROUTES.items():
        prefix = pattern.removesuffix(_ROOM_IN_PATH)
        if route_method == method and prefix != pattern and path.startswith(prefix):
            return route, path[len(prefix) :]
    return None


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


class _BootstrapHTTPServer(ThreadingHTTPServer):
    """A thread per request. The listen backlog is long: at the default of 5, a burst of
    decode posts that came faster than the accept loop took them (its thread short of the GIL
    on a busy engine) lost connections beyond it, and each such decode engine waited out its
    connect timeout and failed the room as if this engine were gone. The kernel caps it at
    net.core.somaxconn."""

    daemon_threads = True
    request_queue_size = 4096


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
        # Heartbeat checks, all at once: one after another, each hung prefill engine added its
        # timeout to the round, and the others' rooms failed that much later.
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
        _handle(_CLIENT_HANDLERS, self, request)

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

Side = TypeVar("Side", BootstrapServer, BootstrapClient)


def _handle(
    handlers: Mapping[type, Callable[[Side, Any], None]], side: Side, request: BootstrapRequest
) -> None:
    handler = handlers.get(type(request))
    if handler is None:  # the other side's request, or a second first one
        raise TypeError(f"not a request for a {type(side).__name__}: {request!r}")
    handler(side, request)


class BootstrapService:
    """The bootstrap process's work: its first request makes it a prefill engine's server
    (ServeBootstrap) or a decode engine's client (ConnectBootstrap), which takes the
    scheduler's requests from then on."""

    def __init__(self, emit: Emit):
        self.emit = emit
        self.side: BootstrapServer | BootstrapClient | None = None

    def handle(self, request: BootstrapRequest) -> None:
        if self.side is None:
            self.side = self._start(request)
        else:
            self.side.handle(request)

    def _start(self, request: BootstrapRequest) -> BootstrapServer | BootstrapClient:
        if isinstance(request, ServeBootstrap):
            server = BootstrapServer(self.emit, request)
            logger.info("bootstrap server listening on %s:%d", request.host, server.port)
            return server
        if isinstance(request, ConnectBootstrap):
            return BootstrapClient(self.emit, request)
        raise TypeError(f"ServeBootstrap or ConnectBootstrap comes first, not {request!r}")

    @property
    def server(self) -> BootstrapServer | None:
        """The prefill engine's server, once ServeBootstrap came."""
        return self.side if isinstance(self.side, BootstrapServer) else None

    def close(self) -> None:
        if self.side is not None:
            self.side.close()


def quiet_request_logs() -> None:
    """httpx logs every request at INFO: a decode engine's heartbeat, every 2 s, made a fifth
    of its log at rest. Failures that matter are logged here; `--log-level debug` shows all."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run_bootstrap(endpoints: Endpoints, log_level: str) -> None:
    """The bootstrap process: requests from scheduler rank 0 in, facts out to its inbox."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s bootstrap %(levelname)s %(message)s"
    )
    quiet_request_logs()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    context = zmq.Context()
    requests = pull(context, endpoints.bootstrap_in)
    facts: queue.Queue[BootstrapFact | None] = queue.Queue()

    def forward() -> None:  # the one thread that owns the socket to the scheduler
        to_scheduler = push(context, endpoints.scheduler_in)
        while (fact := facts.get()) is not None:
            to_scheduler.send_pyobj(fact)

    forwarder = threading.Thread(target=forward, name="kubesgl-bootstrap-facts", daemon=True)
    forwarder.start()
    service = BootstrapService(facts.put)
    while not isinstance(request := requests.recv_pyobj(), Shutdown):
        service.handle(request)
    service.close()
    facts.put(None)
    forwarder.join(timeout=5)


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
