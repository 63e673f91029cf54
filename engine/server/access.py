"""ASGI middleware that sees every request's answer: counts error answers in
kubesgl_request_errors_total (docs/server.md, Metrics) and writes the access log line, one per
request: method, path, status, request id, token counts, TTFT and duration. Never the prompt,
the output, a query string or a header but X-Request-Id, which the answer carries back."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kubesgl.contract import REQUEST_ID_PATTERN
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server.openai_format import Choice

CLIENT_LEFT = 499  # the client disconnected: an abort (kubesgl_requests_total), not an error
_PROBES = frozenset({"/health", "/health_generate"})
QUIET_PATHS = _PROBES | {"/metrics"}  # probes and scrapes: logged at DEBUG
# A client's X-Request-Id is logged when it looks like an id; anything else is not repeated.
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)

access_log = logging.getLogger("kubesgl.access")


@dataclass
class AccessRecord:
    """What the handler learns about a request, for its log line (scope["state"]["access"])."""

    started: float = field(default_factory=time.perf_counter)
    rid: str | None = None
    choices: list[Choice] = field(default_factory=list)  # their token counts, read at the end
    prompts_counted: set[int] = field(default_factory=set)  # the choices whose prompt counts
    ttft: float | None = None

    def first_tokens(self, handoff_s: float = 0.0) -> None:
        """`handoff_s`: how long before its first output a prefill engine had the first token
        (it waited for the decode engine and wrote the KV), which its TTFT leaves out."""
        self.ttft = time.perf_counter() - self.started - handoff_s

    def tokens(self) -> tuple[int, int]:
        prompt = sum(c.prompt_tokens for c in self.choices if c.index in self.prompts_counted)
        return prompt, sum(len(c.token_ids) for c in self.choices)


def request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else None
    return None


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
        record = scope.setdefault("state", {})["access"] = AccessRecord()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # as OpenAI's answers carry theirs (the SDK's `_request_id`): the client's id
                # when it gave one, else the answer's
                if answer_id := request_id(scope) or record.rid:
                    headers = [*message.get("headers", ()), (b"x-request-id", answer_id.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500
            raise
        finally:
            if status is not None and counted_error(scope["path"], status):
                self.metrics.request_error(status)
            log_access(scope, status, record)


def counted_error(path: str, status: int) -> bool:
    """Whether an answer counts in kubesgl_request_errors_total. A probe's 503 is its verdict
    (loading, draining, no token), no request error; its 401 or a crash's 500 is one."""
    if status < 400 or status == CLIENT_LEFT:
        return False
    return not (status == 503 and path in _PROBES)


def log_access(scope: Scope, status: int | None, record: AccessRecord) -> None:
    level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    prompt, output = record.tokens()
    # an error answer without a token: its first outputs were the error (a token id out of
    # the vocabulary, say); a 200 without one (an end at once) had its first outputs
    no_token = status != 200 and not output
    ttft = "-" if record.ttft is None or no_token else f"{record.ttft:.3f}s"
    access_log.log(
        level,
        "%s %s %s request_id=%s rid=%s prompt_tokens=%d output_tokens=%d ttft=%s duration=%.3fs",
        scope["method"],
        scope["path"],
        status if status is not None else "-",
        request_id(scope) or "-",
        record.rid or "-",
        prompt,
        output,
        ttft,
        time.perf_counter() - record.started,
    )
