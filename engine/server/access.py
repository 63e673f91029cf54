"""ASGI middleware that sees every request's answer: counts error answers in
kubesgl_request_errors_total (docs/server.md, Metrics)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kubesgl.engine.metrics import EngineMetrics

CLIENT_LEFT = 499  # the client disconnected: an abort (kubesgl_requests_total), not an error
UNCOUNTED_PATHS = frozenset({"/health"})  # probes: a 503 while loading or draining is no request error


class RequestAccounting:
    """Outermost of the app's middleware (add it last): sees the body limit's 413 as well, and a
    crash as the 500 that Starlette's error middleware answers with."""

    def __init__(self, app: ASGIApp, metrics: EngineMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500
            raise
        finally:
            if status is not None and status >= 400 and status != CLIENT_LEFT and scope["path"] not in UNCOUNTED_PATHS:
                self.metrics.request_error(status)
