"""The handshake of DESIGN.md's P/D protocol (steps 2 and 3) around `KVTransferAgent`.

Prefill side: `BootstrapServer` listens on `--disaggregation-bootstrap-port`. A decode engine
registers there once (`PUT /kv/peers`: its NIXL agent metadata and pool layout), then posts,
per request, the room and the slots it allocated for the prompt (`POST /kv/rooms`).
`PrefillTransfers` pairs each room the scheduler has prefilled with the room the decode side
posted, writes the prompt's KV into those slots and sends the first sampled token in the
transfer's notification.

Decode side: `DecodeTransfers.expect` registers with a prefill engine (once per engine) and
posts the room from a worker thread, so the scheduler never waits on the network; `poll`
reports rooms whose KV has arrived, with their first token, and rooms that failed.

Both sides give up on a room after `timeout` seconds, so the pages of a request whose
partner is gone are freed. The NIXL agent is only touched from the scheduler's thread
(`poll`, `prefilled`); the HTTP threads only fill queues.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from kubesgl.engine.disagg.kv_transfer import KVTransferAgent, PoolLayout, Transfer


@dataclass(frozen=True)
class RoomResult:
    room: int
    first_token: int | None = None  # decode side, on success
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class _RoomTarget:
    room: int
    peer: str
    dst_slots: list[int]
    posted_at: float


class BootstrapServer:
    """HTTP endpoint of a prefill engine for the decode engines' registrations and rooms."""

    def __init__(self, layout: PoolLayout, host: str = "0.0.0.0", port: int = 8998):
        self.layout = layout
        self.peers: queue.Queue[tuple[bytes, PoolLayout]] = queue.Queue()
        self.rooms: queue.Queue[_RoomTarget] = queue.Queue()
        self._http = ThreadingHTTPServer((host, port), self._handler())
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="kubesgl-bootstrap", daemon=True)
        self._thread.start()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802 - http.server's naming
                if self.path != "/kv/peers":
                    return self._reply(404, {"error": f"no such path {self.path}"})
                try:
                    body = self._body()
                    layout = PoolLayout(**{**body["layout"], "k_addresses": tuple(body["layout"]["k_addresses"]),
                                           "v_addresses": tuple(body["layout"]["v_addresses"])})
                    server.layout.check_compatible(layout)
                    metadata = base64.b64decode(body["metadata"])
                except (KeyError, TypeError, ValueError) as exc:
                    return self._reply(400, {"error": str(exc)})
                server.peers.put((metadata, layout))
                self._reply(200, {"agent": server.layout.agent})

            def do_POST(self):  # noqa: N802
                if self.path != "/kv/rooms":
                    return self._reply(404, {"error": f"no such path {self.path}"})
                try:
                    body = self._body()
                    target = _RoomTarget(int(body["room"]), str(body["agent"]), [int(s) for s in body["slots"]],
                                         time.monotonic())
                except (KeyError, TypeError, ValueError) as exc:
                    return self._reply(400, {"error": str(exc)})
                server.rooms.put(target)
                self._reply(200, {})

            def _body(self) -> dict:
                return json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # the engine logs what matters
                pass

        return Handler

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@dataclass
class _Prefilled:
    src_slots: list[int]
    first_token: int
    done_at: float


class PrefillTransfers:
    """Prefill side: sends each prefilled room's KV once its decode side has posted it."""

    def __init__(self, agent: KVTransferAgent, server: BootstrapServer, timeout: float = 60.0):
        self.agent, self.server, self.timeout = agent, server, timeout
        self._prefilled: dict[int, _Prefilled] = {}
        self._targets: dict[int, _RoomTarget] = {}
        self._sending: dict[int, Transfer] = {}

    def prefilled(self, room: int, src_slots: list[int], first_token: int) -> None:
        """The scheduler has computed the prompt of `room` (its KV at `src_slots`) and sampled
        `first_token`; the slots must stay untouched until `poll` reports the room."""
        self._prefilled[room] = _Prefilled(list(src_slots), first_token, time.monotonic())

    def poll(self) -> list[RoomResult]:
        """Rooms whose KV has been sent (or that failed): their slots may be freed."""
        while not self.server.peers.empty():
            metadata, layout = self.server.peers.get()
            if layout.agent not in self.agent.peers:
                self.agent.connect(metadata, layout)
        while not self.server.rooms.empty():
            target = self.server.rooms.get()
            self._targets[target.room] = target
        results = []
        for room in [r for r in self._prefilled if r in self._targets]:
            prefilled, target = self._prefilled.pop(room), self._targets.pop(room)
            message = json.dumps({"room": room, "first_token": prefilled.first_token}).encode()
            try:
                if len(target.dst_slots) != len(prefilled.src_slots):
                    raise ValueError(f"the decode side allocated {len(target.dst_slots)} slots for a "
                                     f"{len(prefilled.src_slots)}-token prompt")
                self._sending[room] = self.agent.write(target.peer, prefilled.src_slots, target.dst_slots, message)
            except (KeyError, ValueError, RuntimeError) as exc:
                results.append(RoomResult(room, error=f"KV transfer not started: {exc}"))
        for room, transfer in list(self._sending.items()):
            try:
                if self.agent.done(transfer):
                    del self._sending[room]
                    results.append(RoomResult(room))
            except RuntimeError as exc:
                del self._sending[room]
                results.append(RoomResult(room, error=str(exc)))
        now = time.monotonic()
        for room in [r for r, p in self._prefilled.items() if now - p.done_at > self.timeout]:
            del self._prefilled[room]
            results.append(RoomResult(room, error=f"no decode engine asked for room {room} within {self.timeout:g} s"))
        for room in [r for r, t in self._targets.items() if now - t.posted_at > self.timeout]:
            del self._targets[room]  # a room this engine never prefilled (its request failed here)
        return results


class DecodeTransfers:
    """Decode side: asks prefill engines for rooms and reports what arrives."""

    def __init__(self, agent: KVTransferAgent, timeout: float = 60.0):
        self.agent, self.timeout = agent, timeout
        self._client = httpx.Client(timeout=10.0)
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubesgl-kv-rooms")
        self._registered: dict[str, Future] = {}  # prefill engine -> its registration
        self._rooms: dict[int, tuple[Future, float]] = {}  # room -> (its post, when it was asked for)

    def expect(self, room: int, bootstrap_host: str, bootstrap_port: int, dst_slots: list[int]) -> None:
        """Ask the prefill engine at host:port to write room's prompt KV into `dst_slots`."""
        base = f"http://{bootstrap_host}:{bootstrap_port}"
        registration = self._registered.get(base)
        if registration is None or (registration.done() and registration.exception() is not None):
            registration = self._registered[base] = self._workers.submit(self._register, base)  # (again)
        post = self._workers.submit(self._post_room, registration, base, room, list(dst_slots))
        self._rooms[room] = (post, time.monotonic())

    def _register(self, base: str) -> None:
        layout = dataclasses.asdict(self.agent.layout)
        body = {"metadata": base64.b64encode(self.agent.metadata).decode(), "layout": layout}
        self._client.put(f"{base}/kv/peers", json=body).raise_for_status()

    def _post_room(self, registration: Future, base: str, room: int, dst_slots: list[int]) -> None:
        registration.result()
        body = {"room": room, "agent": self.agent.name, "slots": dst_slots}
        self._client.post(f"{base}/kv/rooms", json=body).raise_for_status()

    def poll(self) -> list[RoomResult]:
        """Rooms whose KV and first token have arrived, and rooms that failed."""
        results = []
        for message in self.agent.notifications():
            note = json.loads(message)
            room = int(note["room"])
            if self._rooms.pop(room, None) is not None:
                results.append(RoomResult(room, first_token=int(note["first_token"])))
        now = time.monotonic()
        for room, (post, asked_at) in list(self._rooms.items()):
            if post.done() and post.exception() is not None:
                error = f"the prefill engine refused room {room}: {_why(post)}"
            elif now - asked_at > self.timeout:
                error = f"room {room}'s KV did not arrive within {self.timeout:g} s"
            else:
                continue
            del self._rooms[room]
            results.append(RoomResult(room, error=error))
        return results

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _why(future: Future) -> str:
    exc = future.exception()
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            return exc.response.json()["error"]
        except (ValueError, KeyError):
            return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"
