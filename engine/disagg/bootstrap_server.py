"""A prefill engine's side of the bootstrap handshake (docs/disaggregation.md, the bootstrap
server): the HTTP server on `--disaggregation-bootstrap-port` that decode engines register with
(`PUT /kv/peers`), post rooms to (`POST /kv/rooms`), tell of rooms still queued
(`POST /kv/rooms/queued`), ask which rooms ended (`POST /kv/rooms/ended`), cancel rooms at
(`DELETE /kv/rooms/{room}`) and watch (`GET /health`). It runs in the engine's bootstrap process
(bootstrap.py); what arrives goes to the scheduler as a `BootstrapFact`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, get_args

from kubesgl.engine.disagg.protocol import (
    UNKNOWN_PEER,
    UNKNOWN_ROOM,
    BootstrapRequest,
    CancelBody,
    Emit,
    PeerConnected,
    PeerForgotten,
    PeerRegistered,
    PeerRegistration,
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
    WireBody,
    room_in_path,
)

logger = logging.getLogger(__name__)

Answer = tuple[int, dict]  # an HTTP status and its JSON body

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

    def __init__(
        self,
        emit: Emit,
        serve: ServeBootstrap,
        *,
        retry_first_s: float = CONNECT_RETRY_FIRST_S,
        retry_max_s: float = CONNECT_RETRY_MAX_S,
        peer_idle_s: float = PEER_IDLE_S,
    ):
        """`retry_first_s`, `retry_max_s`: the back-off of a decode engine that could not be
        connected to; `peer_idle_s`: the silence after which a decode engine is forgotten."""
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
        self.retry_first_s, self.retry_max_s = retry_first_s, retry_max_s
        self.peer_idle_s = peer_idle_s
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

    def forget_idle_peers(self, idle_s: float | None = None) -> None:
        """Drops the registrations of decode engines silent for `idle_s` (None: peer_idle_s),
        and the back-off of those that have not tried again for as long."""
        now = time.monotonic()
        idle_s = self.peer_idle_s if idle_s is None else idle_s
        with self._lock:
            for engine, heard_at in list(self._heard_at.items()):
                if now - heard_at > idle_s:
                    del self._heard_at[engine], self._engines[engine]
                    self.emit(PeerForgotten(engine))
            for engine, unreachable in list(self._unreachable.items()):
                if now - unreachable.retry_at > idle_s:
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
        handler = _SERVER_HANDLERS.get(type(request))
        if handler is None:  # the client's request, or a second first one
            raise TypeError(f"not a request for a BootstrapServer: {request!r}")
        handler(self, request)

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
            min(2 * last.wait_s, self.retry_max_s)
            if last is not None and last.metadata == metadata
            else self.retry_first_s
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


class _BootstrapHTTPServer(ThreadingHTTPServer):
    """A thread per request. The listen backlog is long: at the default of 5, a burst of
    decode posts that comes faster than the accept loop takes them (its thread short of the
    GIL on a busy engine) loses connections beyond it, and each such decode engine waits out
    its connect timeout and fails the room as if this engine were gone. The kernel caps it at
    net.core.somaxconn."""

    daemon_threads = True
    request_queue_size = 4096
