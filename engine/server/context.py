"""What every route serves with: the engine client and the server's state, as a FastAPI
dependency, and the checks that the OpenAI routes (api.py) and SGLang's (sglang_routes.py)
share: the API key, and whether the server takes requests now. Its own module, so that
sglang_routes.py needs nothing of api.py, which includes its routes."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.server.engine_client import EngineClient
from kubesgl.engine.server.errors import APIError


@dataclass
class ServerState:
    config: EngineConfig
    served_model_name: str
    api_key: str | None = field(default=None, repr=False)  # never logged
    draining: bool = False
    started: int = field(default_factory=lambda: int(time.time()))  # the models' `created`


@dataclass(frozen=True)
class ServerContext:
    """What the handlers serve with, kept on `app.state.server_context` by build_app."""

    client: EngineClient
    state: ServerState


def server_context(request: Request) -> ServerContext:
    return request.app.state.server_context


# a handler's parameter `ctx: Ctx` is its ServerContext, which FastAPI hands it
Ctx = Annotated[ServerContext, Depends(server_context)]


def authorized(request: Request, ctx: Ctx) -> None:
    api_key = ctx.state.api_key
    given = request.headers.get("authorization", "").encode()
    if api_key is not None and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        raise APIError(
            401, "missing or wrong API key", "authentication_error", code="invalid_api_key"
        )


def unavailable(ctx: ServerContext) -> str | None:
    """Why the server takes no request now (a 503), or None: what /health, /health_generate
    and the generation routes all answer by."""
    if ctx.client.failure is not None:  # the server stops, taking nothing new meanwhile
        return ctx.client.failure
    if ctx.state.draining:
        return "the server is shutting down"
    if not ctx.client.ready.is_set():
        return "the model is still loading"
    return None
