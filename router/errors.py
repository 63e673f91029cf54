"""Errors the router answers with, as OpenAI-style error bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def error_body(
    message: str,
    *,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    """The OpenAI error shape shared with the engines: {"error": {message, type, param, code}}.
    As in OpenAI's API and the engine's, `code` is a string (`invalid_api_key`) or null, never
    the HTTP status: typed clients read it as an optional string."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": error_type,
                "param": param,
                "code": code,
            }
        }
    ).encode()


def sse_error_event(message: str) -> bytes:
    """An SSE event that ends a stream which broke after it had started (OpenAI SDKs raise it)."""
    return b"data: " + error_body(message, error_type="upstream_error") + b"\n\n"


@dataclass
class RouterError(Exception):
    """A request the router itself answers with an error (bad input, no worker, bad admin call)."""

    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # beside content-type
    # kubesgl_router_rejections_total's reason; None: the status's (metrics.REJECTION_REASONS)
    reason: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> bytes:
        return error_body(
            self.message, error_type=self.error_type, param=self.param, code=self.code
        )


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param)


def no_worker(message: str) -> RouterError:
    return RouterError(503, message, "service_unavailable")
