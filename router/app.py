"""The router's ASGI application: the engine's HTTP surface plus admin and health endpoints.

Plain ASGI rather than a web framework: every request passes through here, and the few
routes need no more than a dict lookup (benchmarks/README.md, "Why plain ASGI and aiohttp", has the comparison).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import aiohttp

from kubesgl.contract import ADMIN_KEY_ENV, REQUEST_ID_PATTERN, ROUTER_LIVENESS_PATH, not_served
from kubesgl.gc_pacing import GcPacer, tick_every
from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.config import RouterConfig
from kubesgl.router.discovery import PodWatcher
from kubesgl.router.errors import RouterError, bad_request
from kubesgl.router.health import MODELS_PATH, HealthChecker
from kubesgl.router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kubesgl.router.metrics import RouterMetrics
from kubesgl.router.policies import make_policy
from kubesgl.router.request_parsing import (
    GENERATION_PATHS,
    parse_generation_request,
    requested_model,
)
from kubesgl.router.routing import Forwarder, Policies
from kubesgl.router.security import (
    BearerKey,
    Resolve,
    literal_address,
    resolve_host,
    resolved_problem,
)
from kubesgl.router.upstream import (
    SSE_DONE,
    TRY_AGAIN_LATER,
    BufferedReply,
    ConnectionSlots,
    Reply,
    UpstreamClient,
    UpstreamError,
    forwarded_headers,
    make_control_session,
    make_session,
    sse_stream_end,
)
from kubesgl.router.workers import DISCOVERED, Role, WorkerRegistry, validate_worker_url

log = logging.getLogger("kubesgl.router")
access_log = logging.getLogger("kubesgl.router.access")
# probes and scrapes: logged at DEBUG
QUIET_PATHS = frozenset({"/health", ROUTER_LIVENESS_PATH, "/metrics"})
# A client's X-Request-Id is kept (and passed to the engine) when it looks like an id.
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN.encode())

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, bytes], Awaitable[Reply]]

_JSON = [(b"content-type", b"application/json")]
ADMIN_PATH = "/workers"
# The router's own endpoints (probes, scrapes, the admin API): their answers count in
# kubesgl_router_responses_total only when the router rejected the request, as every
# rejection does (kubesgl_router_rejections_total), on any path
OWN_PATHS = frozenset({*QUIET_PATHS, ADMIN_PATH})
# SGLang's description of the model (its vocabulary size, say): answered by a worker, as /v1/models.
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
MODEL_PREFIX = "/v1/models/"
MODEL_PATH = MODEL_PREFIX + "{model}"  # one model's card: one route whatever the model's name
# vLLM's tokenizer routes: every worker has the model's tokenizer (P/D: either role's)
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
# The engine's routes that check its API key: with one set, the router checks it in their place.
CLIENT_PATHS = frozenset(
    {*GENERATION_PATHS, MODELS_PATH, MODEL_PATH, *MODEL_INFO_PATHS, *TOKENIZER_PATHS}
)
_BEARER_CHALLENGE = [(b"www-authenticate", b"Bearer")]


def route_of(path: str) -> str:
    """The route a request path takes."""
    return MODEL_PATH if path.startswith(MODEL_PREFIX) else path


def card_model(path: str) -> str | None:
    """The model a card's path names, unencoded (None: the path is no card's)."""
    return path.removeprefix(MODEL_PREFIX) if route_of(path) == MODEL_PATH else None


def models_path(path: str) -> str:
    """The path a models request is forwarded with. A model's name goes as one percent-encoded
    segment: as it came ("../../flush_cache", decoded by the server), the worker's URL would
    resolve it to another of the engine's routes, called with the router's engine key."""
    model = card_model(path)
    if model is None:
        return path
    if model in ("", ".", ".."):  # a segment no percent-encoding keeps from resolving
        # in the engines' (and OpenAI's) shape for a model not served
        raise RouterError(
            404, f"the model {model!r} does not exist", param="model", code="model_not_found"
        )
    return MODEL_PREFIX + quote(model, safe="")


def _model_of(path: str, body: bytes) -> str | None:
    """The model a request for one worker names: a model's card, or a tokenizer request's
    `model` (a body that is no JSON names none: the engine says what is wrong with it)."""
    if (model := card_model(path)) is not None:
        return model
    if path not in TOKENIZER_PATHS:
        return None
    try:
        return requested_model(json.loads(body))
    except (ValueError, RecursionError):
        return None


def json_reply(status: int, payload: object) -> BufferedReply:
    return BufferedReply(status, list(_JSON), json.dumps(payload).encode())


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


@dataclass
class _Exchange:
    """Per-request state shared with the task that watches for the client leaving."""

    task: asyncio.Task[Any]
    answered: bool = False  # the last byte is on its way: a disconnect is no longer news
    disconnected: bool = False
    cut: bool = False  # the router's shutdown cut its stream, which it ended (_send)


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        gc_pacer: GcPacer | None = None,
        check_signal: signal.Signals | None = None,
    ) -> None:
        """`gc_pacer`: the router process's (kubesgl/gc_pacing.py), started at the end of
        start-up; None leaves the garbage collector as it is (tests in one process).
        `check_signal`: the router process's contract.ROUTER_CHECK_SIGNAL, handled from
        start-up on (before /health first answers, after which `kubesgl up` may send it) and
        ignored from shut-down on; None handles no signal (tests in one process)."""
        self.config = config
        self.gc_pacer = gc_pacer
        self.check_signal = check_signal
        self.workers = WorkerRegistry(
            make_breaker=lambda: CircuitBreaker(
                config.breaker_failure_threshold, config.breaker_cooldown_s
            )
        )
        self.metrics = RouterMetrics(self.workers)
        self._session: aiohttp.ClientSession | None = None  # the requests it passes on
        self._control_session: aiohttp.ClientSession | None = None  # its own: health, cancels
        self._forwarder: Forwarder | None = None
        self._health: HealthChecker | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._admin_key = (
            BearerKey(config.admin_api_key) if config.admin_api_key is not None else None
        )
        self._client_key = BearerKey(config.api_key) if config.api_key is not None else None
        # What engines get in place of the client's credentials.
        self._credentials = [self._client_key.header] if self._client_key is not None else []
        # How the admin API looks up a worker's host name; tests replace it.
        self.resolve: Resolve = resolve_host
        self._routes: dict[str, dict[str, Handler]] = {
            **{path: {"POST": self._generate} for path in GENERATION_PATHS},
            MODELS_PATH: {"GET": self._list_models},
            **{
                path: {"GET": self._any_worker}
                for path in (MODEL_PATH, *MODEL_INFO_PATHS, "/version")
            },
            **{path: {"POST": self._any_worker} for path in TOKENIZER_PATHS},
            "/health": {"GET": self._health_status},
            ROUTER_LIVENESS_PATH: {"GET": self._liveness},
            "/metrics": {"GET": self._metrics},
            ADMIN_PATH: {
                "GET": self._list_workers,
                "POST": self._add_worker,
                "DELETE": self._remove_worker,
            },
        }

    @property
    def forwarder(self) -> Forwarder:
        if self._forwarder is None:
            raise RuntimeError("the router has not started (ASGI lifespan startup)")
        return self._forwarder

    # -- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        c = self.config
        self._session = make_session(c.connect_timeout_s, c.request_timeout_s)
        self._control_session = make_control_session()
        policy = lambda name: make_policy(name or c.policy, c.cache_aware)  # noqa: E731
        policies = Policies(policy(c.policy), policy(c.prefill_policy), policy(c.decode_policy))
        upstream = UpstreamClient(
            self._session,
            self.metrics,
            on_worker_lost=self.workers.mark_lost,
            # the slot wait is bounded as a connection is: a request is refused in that time
            slots=ConnectionSlots(c.max_connections, c.connect_timeout_s),
            control_session=self._control_session,
        )
        self._forwarder = Forwarder(
            self.workers,
            policies,
            upstream,
            self.metrics,
            c.retry,
            c.disaggregation,
            max(1, math.ceil(min(c.health.interval_s, c.breaker_cooldown_s))),
        )
        probe_headers = {k.decode(): v.decode() for k, v in self._credentials}
        self._health = HealthChecker(self.workers, self._control_session, c.health, probe_headers)
        for url in c.workers:
            self.workers.add(url, Role.MIXED)
        for url, port in c.prefill:
            self.workers.add(url, Role.PREFILL, port)
        for url in c.decode:
            self.workers.add(url, Role.DECODE)
        # The first round before the first request: a router that starts (or restarts) in
        # front of ready engines would refuse it, its workers not yet checked. At most a
        # check's timeout and a /v1/models question's, per worker, all at once.
        await self._health.check_all()
        self._tasks.append(asyncio.create_task(self._health.run()))
        if self.check_signal is not None:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(self.check_signal, self._health.check_out_of_pool)
        if c.kube is not None:
            watcher = PodWatcher(
                self.workers, c.kube.namespace, c.kube.selector, c.kube.worker_port
            )
            self._tasks.append(asyncio.create_task(watcher.run()))
        if self.gc_pacer is not None:
            self.gc_pacer.start()  # start-up is over: what is alive now stays
            busy = lambda: any(worker.in_flight for worker in self.workers.all())  # noqa: E731
            self._tasks.append(asyncio.create_task(tick_every(self.gc_pacer, busy)))

    async def shutdown(self) -> None:
        if self.check_signal is not None:
            asyncio.get_running_loop().remove_signal_handler(self.check_signal)
            # a late one is ignored: its default would end the process mid-shut-down
            signal.signal(self.check_signal, signal.SIG_IGN)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._health is not None:
            self._health.close()
        if self._forwarder is not None:  # its prefill drains and room cancels use the sessions
            await self._forwarder.aclose()
        for session in (self._session, self._control_session):
            if session is not None:
                await session.close()

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serves the request and writes its access log line: method, path, status, request id,
        time to the first body byte and duration; never a body, a query string or a key."""
        started = time.perf_counter()
        rid = _request_id(scope)
        status: int | None = None
        first_byte: float | None = None
        last_body, ended = b"", False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status, first_byte, last_body, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    # the router's own answers, and an engine's that did not carry it back
                    headers.append((b"x-request-id", rid.encode()))
                    message = {**message, "headers": headers}
            else:
                if body := message.get("body"):
                    last_body = body
                    if first_byte is None:
                        first_byte = time.perf_counter() - started
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self._serve(scope, receive, sending)
        finally:
            path = scope["path"]
            if first_byte is not None and status == 200 and path in GENERATION_PATHS:
                self.metrics.time_to_first_byte.observe(first_byte)
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                # an answer begun whose end was never sent: its client left mid-answer (a
                # stream's client that leaves at its [DONE] had it whole)
                unfinished = status is not None and not ended and not last_body.endswith(SSE_DONE)
                access_log.log(
                    level,
                    "%s %s %s request_id=%s ttfb=%s duration=%.3fs%s",
                    scope["method"],
                    path,
                    status if status is not None else "-",
                    rid,
                    "-" if first_byte is None else f"{first_byte:.3f}s",
                    time.perf_counter() - started,
                    " unfinished" if unfinished else "",
                )

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            handler = self._handler(scope)
            self._authorize(scope)  # before the body is read: strangers' bodies are not buffered
            started = time.perf_counter()
            body = await _read_body(receive, self.config.max_request_bytes)
        except _ClientGone:
            return
        except RouterError as error:  # no such route or method, no key, a body too large
            await self._send(send, self._rejected(error), counted=True)
            return
        exchange = _Exchange(asyncio.current_task())  # type: ignore[arg-type]
        watcher = asyncio.create_task(_watch_disconnect(receive, exchange))
        try:
            counted = scope["path"] not in OWN_PATHS
            try:
                reply = await handler(scope, body)
            except (RouterError, UpstreamError) as error:
                reply, counted = self._rejected(error), True
            except Exception:
                log.exception("unexpected error in %s %s", scope["method"], scope["path"])
                internal = RouterError(500, "internal router error", "internal_error")
                reply, counted = self._rejected(internal), True
            await self._send(send, reply, exchange, counted=counted)
        except asyncio.CancelledError:
            if not (exchange.disconnected or exchange.cut):
                raise
            # the client left, or the shutdown cut its stream, ended: its upstream request is
            # closed, done
            exchange.task.uncancel()
        finally:
            watcher.cancel()
            if scope["path"] in GENERATION_PATHS:
                self.metrics.request_duration.observe(time.perf_counter() - started)

    def _handler(self, scope: Scope) -> Handler:
        """The handler of the request's route and method; a 404 or a 405 where there is none."""
        methods = self._routes.get(route_of(scope["path"]))
        if methods is None:
            message = not_served(scope["path"]) or f"no route for {scope['method']} {scope['path']}"
            raise RouterError(404, message, "not_found_error")
        handler = methods.get(scope["method"])
        if handler is None:
            allowed = ", ".join(methods)
            raise RouterError(
                405,
                f"{scope['path']} accepts {allowed}",
                headers=[(b"allow", allowed.encode())],  # which HTTP requires of a 405
            )
        return handler

    def _rejected(self, error: RouterError | UpstreamError) -> BufferedReply:
        """The error answer; one the router gives itself (no worker's) is counted as a rejection."""
        if isinstance(error, RouterError):
            self.metrics.rejected(error.status, error.reason)
        return _error_reply(error)

    async def _send(
        self, send: Send, reply: Reply, exchange: _Exchange | None = None, *, counted: bool
    ) -> None:
        """Sends the answer; `counted`: one a client gets for its request, counted by status
        as it starts (kubesgl_router_responses_total)."""
        if counted:
            self.metrics.answered(reply.status)
        if isinstance(reply, BufferedReply):
            headers = reply.headers + [(b"content-length", str(len(reply.body)).encode())]
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            if exchange is not None:
                exchange.answered = True
            await send({"type": "http.response.body", "body": reply.body})
            return
        last = b""
        try:
            async with contextlib.aclosing(reply.chunks) as chunks:
                await send(
                    {
                        "type": "http.response.start",
                        "status": reply.status,
                        "headers": reply.headers,
                    }
                )
                async for chunk in chunks:
                    last = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if exchange is not None:
                    exchange.answered = True
                await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            # Cancelled, and not for its client leaving: the graceful shutdown's time is up
            # (uvicorn cancels what still runs). The stream ends as one a worker broke off
            # does, not silently; its worker's request is closed (aclosing), no failure of it.
            if exchange is None or exchange.disconnected or exchange.answered:
                raise
            exchange.cut = exchange.answered = True
            end = b""
            if not last.endswith(SSE_DONE):  # cut short: no longer whole
                end = sse_stream_end(last, _cut_message(self.config))
                self.metrics.broken_streams.labels("shutdown").inc()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CUT_SEND_TIMEOUT_S):  # a client that reads no more
                    await send({"type": "http.response.body", "body": end})
            raise

    # -- handlers ----------------------------------------------------------------------------

    def _authorize(self, scope: Scope) -> None:
        """The client's key on the engine's protected routes (when the router has the engines'
        key), the admin key on the admin API."""
        path = route_of(scope["path"])
        if path == ADMIN_PATH:
            self._check_admin(scope)
        elif (
            path in CLIENT_PATHS
            and self._client_key is not None
            and not self._client_key.admits(scope["headers"])
        ):
            raise RouterError(
                401,
                "missing or wrong API key",
                "authentication_error",
                code="invalid_api_key",
                headers=list(_BEARER_CHALLENGE),
            )

    def _check_admin(self, scope: Scope) -> None:
        """With an admin key, every /workers call needs it. Without one, the pool cannot be
        changed at all (403), and GET /workers stays open: it shows the URLs, health and load
        that the open /metrics shows already, plus role, bootstrap port and circuit state."""
        if self._admin_key is None:
            if scope["method"] == "GET":
                return
            raise RouterError(
                403,
                f"the admin API is off: this router was started without an admin key. Start it with the "
                f"environment variable {ADMIN_KEY_ENV} set to a secret key (on Kubernetes: the InferenceService's "
                f"spec.router.adminKeySecret), "
                f"then send `Authorization: Bearer <key>`",
                "permission_error",
            )
        if not self._admin_key.admits(scope["headers"]):
            raise RouterError(
                401,
                "admin endpoints need `Authorization: Bearer <admin key>`",
                "authentication_error",
                headers=list(_BEARER_CHALLENGE),
            )

    def _upstream_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        return forwarded_headers(scope["headers"], self._credentials)

    async def _generate(self, scope: Scope, body: bytes) -> Reply:
        request = parse_generation_request(scope["path"], body)
        return await self.forwarder.generate(request, self._upstream_headers(scope))

    async def _list_models(self, scope: Scope, body: bytes) -> Reply:
        return await self.forwarder.list_models(self._upstream_headers(scope))

    async def _any_worker(self, scope: Scope, body: bytes) -> Reply:
        return await self.forwarder.any_worker(
            scope["method"],
            models_path(scope["path"]),
            body if scope["method"] == "POST" else None,
            self._upstream_headers(scope),
            _model_of(scope["path"], body),
        )

    def missing_role(self) -> Role | None:
        """The role the router cannot serve without, when no worker of it can serve (None: it
        can serve). In P/D mode that is the decode pool alone: while no prefill worker can
        serve, a decode worker prefills each request itself."""
        needed = Role.DECODE if self.workers.is_disaggregated() else Role.MIXED
        return None if self.workers.available(needed) else needed

    def can_serve(self) -> bool:
        return self.missing_role() is None

    def degraded(self) -> str | None:
        """Why the router serves without a part of its pool (P/D mode, no prefill worker can
        serve: requests go to a decode worker alone), or None."""
        if not self.workers.is_disaggregated() or self.workers.available(Role.PREFILL):
            return None
        missing = self.forwarder.no_worker_error(Role.PREFILL).message
        return f"{missing}; requests go to a decode worker alone, which prefills them itself"

    async def _health_status(self, scope: Scope, body: bytes) -> Reply:
        if (role := self.missing_role()) is not None:  # the answer says which role, and why
            # Returned, not raised: the router's readiness answer is no request it rejected, and
            # counts in no rejection (or no-worker request) metric.
            return _error_reply(self.forwarder.no_worker_error(role))
        if (reason := self.degraded()) is not None:  # ready: the decode pool serves every request
            return json_reply(200, {"status": "degraded", "message": reason})
        return json_reply(200, {"status": "ok"})

    async def _liveness(self, scope: Scope, body: bytes) -> Reply:
        # Answered by the event loop that serves every request, so a wedged router fails it;
        # the workers are /health's matter, which no restart of the router would mend.
        return json_reply(200, {"status": "ok"})

    async def _metrics(self, scope: Scope, body: bytes) -> Reply:
        return BufferedReply(
            200, [(b"content-type", METRICS_CONTENT_TYPE.encode())], self.metrics.render()
        )

    async def _list_workers(self, scope: Scope, body: bytes) -> Reply:
        return json_reply(200, {"workers": [w.describe() for w in self.workers.all()]})

    async def _add_worker(self, scope: Scope, body: bytes) -> Reply:
        try:
            spec = json.loads(body)
        except (ValueError, RecursionError):
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise bad_request(
                'expected {"url": URL, "role": "mixed|prefill|decode", "bootstrap_port": PORT}',
                "url",
            )
        try:
            role = Role(spec.get("role", Role.MIXED.value))
        except ValueError:
            raise bad_request("`role` must be mixed, prefill or decode", "role") from None
        port = spec.get("bootstrap_port")
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536
        ):
            raise bad_request("`bootstrap_port` must be a port number", "bootstrap_port")
        try:
            url = validate_worker_url(spec["url"])
        except ValueError as exc:
            raise bad_request(str(exc), "url") from None
        await self._check_resolved(url)
        worker = self.workers.add(url, role, port, source="admin")
        return json_reply(200, {"worker": worker.describe()})

    async def _check_resolved(self, url: str) -> None:
        """A host name must resolve, and to no link-local or metadata address (the connection
        pool checks again at every connection: a name may change its answer)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if literal_address(host) is not None:
            return  # an address, checked as written
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                addresses = await self.resolve(host, port)
        except (OSError, TimeoutError) as exc:
            raise bad_request(
                f"the worker's host {host} does not resolve ({str(exc) or type(exc).__name__}); "
                "add it once it does",
                "url",
            ) from None
        problem = resolved_problem(host, addresses)
        if problem is not None:
            raise bad_request(
                f"worker URL {url!r}: {problem}; the router never sends requests there", "url"
            )

    async def _remove_worker(self, scope: Scope, body: bytes) -> Reply:
        urls = parse_qs(scope.get("query_string", b"").decode()).get("url", [])
        if len(urls) != 1:
            raise bad_request("name the worker to remove: DELETE /workers?url=URL", "url")
        try:
            worker = self.workers.get(urls[0])
        except ValueError as exc:
            raise bad_request(str(exc), "url") from None
        if worker is None:
            raise RouterError(404, f"no worker {urls[0]!r} is registered", "not_found_error", "url")
        if worker.source == DISCOVERED:
            # Discovery would never add it back while its pod stays ready: the pool follows the
            # cluster, so the pod is what to change.
            raise RouterError(
                409,
                f"worker {worker.url} is pod {worker.pod}, found by Kubernetes discovery, and "
                "follows the pod: it leaves the pool when the pod is not ready, is deleted, or "
                "no longer matches --kube-selector (change one of the labels it names); the "
                "admin API removes only the workers it or the command line added",
                "invalid_request_error",
                "url",
                code="discovered_worker",
            )
        self.workers.remove(worker.url)
        return json_reply(200, {"removed": worker.url})


# How long the last event of a stream the shutdown cuts may take to send
_CUT_SEND_TIMEOUT_S = 1.0


def _cut_message(config: RouterConfig) -> str:
    return (
        "the router is shutting down and its --shutdown-timeout "
        f"({config.shutdown_timeout_s:g} s) is over: the stream was cut; send the request again"
    )


# A 500 (an engine's failure, or the router's own) is not to be sent again: OpenAI's SDKs
# retry 5xx unless the answer says so, as the engines' own 500s do
_NO_RETRY = [(b"x-should-retry", b"false")]


def _error_reply(error: RouterError | UpstreamError) -> BufferedReply:
    if isinstance(error, RouterError):
        extra = error.headers
    else:
        # a worker's 503 passed on (every worker tried was busy): when to try again, as the
        # worker said if it did (its queue's wait, its drain's end), else the router's second
        extra = [_retry_after(error)] if error.status == 503 else []
    no_retry = _NO_RETRY if error.status == 500 else []
    return BufferedReply(error.status, list(_JSON) + extra + no_retry, error.body())


def _retry_after(error: UpstreamError) -> tuple[bytes, bytes]:
    if error.retry_after is None:
        return TRY_AGAIN_LATER
    return (b"retry-after", error.retry_after)


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id, or a new one added to the request (engines get it too)."""
    for name, value in scope["headers"]:
        if name.lower() == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value.decode()
    rid = uuid.uuid4().hex  # a client's value that is no id is replaced, never repeated
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"]
    scope["headers"].append((b"x-request-id", rid.encode()))
    return rid


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouterError(
                413, f"the request body is larger than {limit} bytes", "invalid_request_error"
            )
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _watch_disconnect(receive: Receive, exchange: _Exchange) -> None:
    """Cancels the request's task when its client disconnects, which closes the upstream request."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not exchange.answered:
        exchange.disconnected = True
        exchange.task.cancel()
