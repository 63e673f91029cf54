"""Fake engines for the router tests: real HTTP servers on loopback ports that imitate the
engine's surface (/health, /metrics, /v1/models, SSE and JSON completions) and, in P/D mode,
check the bootstrap fields and hand a "KV cache" from prefill to decode through a shared table.

A fake prefill engine also serves the bootstrap server's room cancel (`DELETE /kv/rooms/{room}`),
which fails a room whose KV it has not sent, as an engine's cancel tells its decode engine.

They run in the test's event loop, so tests can await what happens inside them, and `kill()`
aborts every connection at once, as a crashed process would.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kubesgl.contract import KV_LAYOUT_HEADER

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# the stop string a fake answer says ended it, as a real engine answers stop_reason and SGLang's
# finish_reason.matched: the router passes it through untouched
STOP_REASON = "</end>"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "fake_error", "param": None, "code": status}}
    return web.json_response(body, status=status)


class RoomFailed(Exception):
    pass


@dataclass
class KVTransferTable:
    """Rooms a fake prefill has filled, keyed by (bootstrap host, bootstrap port, room)."""

    rooms: dict[tuple[str, int, int], asyncio.Future[str]] = field(default_factory=dict)
    asked: dict[tuple[str, int, int], asyncio.Event] = field(default_factory=dict)  # by decode

    def _room(self, key: tuple[str, int, int]) -> asyncio.Future[str]:
        if key not in self.rooms:
            self.rooms[key] = asyncio.get_running_loop().create_future()
        return self.rooms[key]

    def fill(self, key: tuple[str, int, int], prefill_name: str) -> None:
        self._room(key).set_result(prefill_name)

    def fail(self, key: tuple[str, int, int], error: str) -> bool:
        """The prefill failed the room and told its decode engine, as an engine does; False
        when the room had ended already (its KV sent, or failed before)."""
        room = self._room(key)
        if room.done():
            return False
        room.set_exception(RoomFailed(error))
        room.exception()  # retrieved: no decode engine may wait for it (one that failed first)
        return True

    async def wait(self, key: tuple[str, int, int], timeout: float) -> str:
        self.asked.setdefault(key, asyncio.Event()).set()
        return await asyncio.wait_for(asyncio.shield(self._room(key)), timeout)

    async def until_asked(self, key: tuple[str, int, int], timeout: float) -> None:
        """Until a decode engine asks for the room (its post to the bootstrap server)."""
        await asyncio.wait_for(self.asked.setdefault(key, asyncio.Event()).wait(), timeout)


class FakeEngine:
    def __init__(
        self,
        name: str,
        role: str = "mixed",
        *,
        tokens: int = 4,
        kv: KVTransferTable | None = None,
        bootstrap_port: int | None = None,
        prefix_cache_chars: int = 0,
        api_key: str | None = None,
        model: str = "fake-model",
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.model = model  # its served model name
        self.aliases = aliases  # more names it serves, listed after it (vLLM's served names)
        self.role = role
        self.tokens = tokens
        self.kv = kv
        self.bootstrap_port = bootstrap_port or _free_port()
        self.port = _free_port()
        self.healthy = True
        # a prefill or decode engine's KV layout fingerprint, named by its /health; None: none
        self.kv_layout: str | None = None
        self.fail_status: int | None = None  # answer every generation request with this error
        self.models_status: int | None = None  # answer GET /v1/models with this error
        self.fail_after_s = 0.0  # ... this long after the request came
        self.fail_after_kv: int | None = None  # prefill: send the KV cache, then this error
        self.late_answer_s = 0.0  # prefill: fail the room at once, answer the error this late
        # prefill: as a real engine, take the request, then wait (up to this long) for its decode
        # engine to ask for the room before the KV cache is sent; None: send it at once
        self.room_wait_s: float | None = None
        # prefill: answer fail_status without taking the room (a crashed handler's or a proxy's
        # 5xx), so nobody tells the decode engine
        self.fail_without_room = False
        # prefill: hung (SIGSTOP): takes a request and never answers it, and its decode engine's
        # post of the room to its bootstrap server times out after this many seconds, which
        # fails the room there (502 "could not be reached ... ReadTimeout")
        self.hung_post_timeout_s: float | None = None
        self.cancelled_rooms: list[tuple[int, dict[str, Any]]] = []  # DELETE /kv/rooms, in order
        # While set to an unset Event, answers pause (streams after their first chunk) until it is set.
        self.hold: asyncio.Event | None = None
        self.hold_after_chunks = 1
        self.eof_after_done_s = 0.0  # streams: the end of the body comes this long after [DONE]
        self.requests: list[dict[str, Any]] = []
        # As `kubesgl serve --api-key`: generation and /v1/models need `Authorization: Bearer KEY`.
        self.api_key = api_key
        self.probe_headers: list[dict[str, str]] = []  # of every /health request
        self.models_headers: list[dict[str, str]] = []  # of every /v1/models request
        self.stream_started = asyncio.Event()
        self.client_gone = asyncio.Event()  # a client hung up mid-answer
        self._received = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._bootstrap_runner: web.AppRunner | None = None
        # Simulated prefix cache, bounded like a real KV pool: recent prompts (LRU order), and
        # the share of prompt characters found cached. 0 turns it off.
        self.prefix_cache_chars = prefix_cache_chars
        self._cached_prompts: dict[str, None] = {}
        self._prompt_chars = 0
        self._cached_chars = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def prefix_cache_hit_ratio(self) -> float:
        return self._cached_chars / self._prompt_chars if self._prompt_chars else 0.0

    @property
    def models_listed(self) -> int:
        """The /v1/models requests of clients, through the router: they carry a request id, the
        router's own health checks none."""
        return sum(any(k.lower() == "x-request-id" for k in h) for h in self.models_headers)

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, self._generate)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        self._runner = web.AppRunner(
            # handler_cancellation: a client hanging up cancels the handler, as in an engine
            app,
            shutdown_timeout=0.2,
            access_log=None,
            handler_cancellation=True,
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        if self.role == "prefill" and self.kv is not None:
            bootstrap = web.Application()
            bootstrap.router.add_delete("/kv/rooms/{room}", self._cancel_room)
            self._bootstrap_runner = web.AppRunner(bootstrap, access_log=None)
            await self._bootstrap_runner.setup()
            site = web.TCPSite(self._bootstrap_runner, "127.0.0.1", self.bootstrap_port)
            await site.start()
        return self

    async def kill(self) -> None:
        """Every connection is cut at once and the port stops listening, like a crash."""
        assert self._runner is not None
        for connection in self._runner.server.connections if self._runner.server else []:
            if connection.transport is not None:
                connection.transport.abort()
        await self._runner.cleanup()
        self._runner = None
        if self._bootstrap_runner is not None:
            await self._bootstrap_runner.cleanup()
            self._bootstrap_runner = None

    async def restart(self) -> None:
        await self.start()

    async def wait_for_requests(self, count: int) -> None:
        while len(self.requests) < count:
            self._received.clear()
            await self._received.wait()

    # -- handlers ----------------------------------------------------------------------------

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if (
            self.api_key is not None
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return _error(401, "missing or wrong API key")
        return None

    async def _record(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        """A request's body, once recorded in `requests` (refused ones too), and the 401 to
        answer when it lacks the key."""
        body = await request.json()
        self.requests.append({"path": request.path, "body": body, "headers": dict(request.headers)})
        self._received.set()
        return body, self._unauthorized(request)

    async def _health(self, request: web.Request) -> web.Response:
        self.probe_headers.append(dict(request.headers))
        if not self.healthy:
            return _error(503, "not ready")
        layout = {KV_LAYOUT_HEADER: self.kv_layout} if self.kv_layout else None
        return web.json_response({"status": "ok"}, headers=layout)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            f'kubesgl_prefix_cache_hit_ratio{{role="{self.role}"}} {self.prefix_cache_hit_ratio}\n'
            f'kubesgl_prompt_tokens_total{{role="{self.role}"}} {self._prompt_chars}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.models_headers.append(dict(request.headers))
        unauthorized = self._unauthorized(request)
        if unauthorized is not None:
            return unauthorized
        if self.models_status is not None:
            return _error(self.models_status, f"{self.name} fails on purpose")
        names = (self.model, *self.aliases)
        cards = [{"id": name, "object": "model", "owned_by": self.name} for name in names]
        return web.json_response({"object": "list", "data": cards})

    async def _model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in (self.model, *self.aliases):
            return web.json_response({"error": {"code": "model_not_found"}}, status=404)
        return web.json_response({"id": model, "object": "model"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """One token per character, its code point."""
        body, unauthorized = await self._record(request)
        if unauthorized is not None:
            return unauthorized
        tokens = [ord(c) for c in body["prompt"]]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body, unauthorized = await self._record(request)
        if unauthorized is not None:
            return unauthorized
        return web.json_response({"prompt": "".join(map(chr, body["tokens"]))})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"{self.name}-version"})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, unauthorized = await self._record(request)
        if unauthorized is not None:
            return unauthorized
        if self.role == "prefill" and self.hung_post_timeout_s is not None:
            return await self._hang(body, self.hung_post_timeout_s)
        if self.fail_status is not None:
            try:
                await asyncio.sleep(self.fail_after_s)
            except asyncio.CancelledError:
                self.client_gone.set()
                raise
            message = f"{self.name} fails on purpose"
            if (
                self.role == "prefill"
                and self.fail_status >= 500
                and self.fail_status != 503
                and not self.fail_without_room
            ):
                self._fail_rooms(body, message)  # a 503 refuses before any work: nobody is told
                await asyncio.sleep(self.late_answer_s)
            return _error(self.fail_status, message)
        if self.prefix_cache_chars:
            self._record_prompt(_prompt_of(request.path, body))
        if self.role == "prefill":
            return await self._prefill(request, body)
        if self.role == "decode" and "bootstrap_room" in body:  # without a room: it prefills itself
            problem = _bootstrap_problem(body)
            if problem:
                return _error(400, problem)
            assert self.kv is not None
            try:
                for room in _rooms(body):
                    await self.kv.wait(
                        (body["bootstrap_host"], body["bootstrap_port"], room), timeout=5.0
                    )
            except TimeoutError:
                return _error(500, f"{self.name}: KV cache of room {room} never arrived")
            except RoomFailed as exc:
                return _error(502, f"{self.name}: room {room} failed at the prefill: {exc}")
            except asyncio.CancelledError:
                self.client_gone.set()
                raise
        if body.get("stream"):
            return await self._stream(request)
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.client_gone.set()
                raise
        return web.json_response(self._completion(request.path))

    async def _prefill(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        problem = _bootstrap_problem(body)
        if problem:
            return _error(400, problem)
        if body["bootstrap_host"] != "127.0.0.1" or body["bootstrap_port"] != self.bootstrap_port:
            return _error(400, f"{self.name}: bootstrap address is not mine")
        assert self.kv is not None
        for room in _rooms(body):
            key = (body["bootstrap_host"], body["bootstrap_port"], room)
            if self.room_wait_s is not None:
                try:
                    await self.kv.until_asked(key, self.room_wait_s)
                except TimeoutError:
                    return _error(504, f"{self.name}: no decode engine asked for room {room}")
            self.kv.fill(key, self.name)
        if self.fail_after_kv is not None:
            return _error(self.fail_after_kv, f"{self.name} fails after sending the KV cache")
        if self.hold is not None:  # the KV cache is sent, the answer is not
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.client_gone.set()
                raise
        return web.json_response(self._completion(request.path))

    async def _hang(self, body: dict[str, Any], post_timeout_s: float) -> web.Response:
        address = f"http://{body['bootstrap_host']}:{body['bootstrap_port']}"
        rooms = _rooms(body)
        reason = (
            f"the prefill engine at {address} could not be reached for room {rooms[0]}: "
            "ReadTimeout: timed out"
        )
        # the decode engine's post times out whether or not the router closes this request
        asyncio.get_running_loop().call_later(post_timeout_s, self._fail_rooms, body, reason)
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            self.client_gone.set()
            raise
        raise AssertionError("unreachable")

    async def _cancel_room(self, request: web.Request) -> web.Response:
        room, body = int(request.match_info["room"]), await request.json()
        self.cancelled_rooms.append((room, body))
        assert self.kv is not None
        error = f"room {room} was cancelled: {body['reason']}"
        if self.kv.fail(("127.0.0.1", self.bootstrap_port, room), error):
            return web.json_response({"write_in_flight": False})
        return web.json_response({"error": "never posted", "code": "unknown_room"}, status=404)

    def _fail_rooms(self, body: dict[str, Any], error: str) -> None:
        assert self.kv is not None
        for room in _rooms(body):
            self.kv.fail((body["bootstrap_host"], body["bootstrap_port"], room), error)

    def _text(self, index: int) -> str:
        return f"{self.name}-tok{index} "

    def _completion(self, path: str) -> dict[str, Any]:
        text = "".join(self._text(i) for i in range(self.tokens))
        if path == "/v1/chat/completions":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "stop_reason": STOP_REASON,
            }
            return {"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake-model",
                    "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": self.tokens, "total_tokens": 1 + self.tokens}}  # fmt: skip
        if path == "/v1/completions":
            return {"id": "cmpl-fake", "object": "text_completion", "model": "fake-model",
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": STOP_REASON}]}  # fmt: skip
        return {"text": text, "meta_info": {"finish_reason": {"type": "stop", "matched": STOP_REASON}}}  # fmt: skip

    def _chunk(self, path: str, index: int) -> bytes:
        text = self._text(index)
        if path == "/v1/chat/completions":
            payload = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake-model",
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
        elif path == "/v1/completions":
            payload = {"id": "cmpl-fake", "object": "text_completion", "model": "fake-model",
                       "choices": [{"index": 0, "text": text, "finish_reason": None}]}  # fmt: skip
        else:
            payload = {"text": text}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            for index in range(self.tokens):
                await response.write(self._chunk(request.path, index))
                self.stream_started.set()
                if index + 1 == self.hold_after_chunks and self.hold is not None:
                    await self.hold.wait()
            await response.write(b"data: [DONE]\n\n")
            await asyncio.sleep(self.eof_after_done_s)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.client_gone.set()
            raise
        return response

    def _record_prompt(self, prompt: str) -> None:
        cached = max((_common_prefix(prompt, seen) for seen in self._cached_prompts), default=0)
        self._prompt_chars += len(prompt)
        self._cached_chars += cached
        self._cached_prompts.pop(prompt, None)
        self._cached_prompts[prompt] = None
        while sum(map(len, self._cached_prompts)) > self.prefix_cache_chars:
            del self._cached_prompts[next(iter(self._cached_prompts))]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompt_of(path: str, body: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        return "".join(f"{m['role']}:{m['content']}\n" for m in body["messages"])
    return body.get("prompt") or body.get("text") or ""


def _bootstrap_problem(body: dict[str, Any]) -> str | None:
    host, port, room = (
        body.get("bootstrap_host"),
        body.get("bootstrap_port"),
        body.get("bootstrap_room"),
    )
    if not isinstance(host, str) or not host:
        return "bootstrap_host must be a non-empty string"
    if not isinstance(port, int) or isinstance(port, bool):
        return "bootstrap_port must be an integer"
    rooms = room if isinstance(room, list) and room else [room]
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2**63 for r in rooms):
        return "bootstrap_room must be a 63-bit non-negative integer, or a list of them"
    return None


def _rooms(body: dict[str, Any]) -> list[int]:
    room = body["bootstrap_room"]
    return room if isinstance(room, list) else [room]
