"""The server's error answers: OpenAI's error body, an engine error in the words of the
client's request, the app's handlers that answer every error so (a bad body, an unknown route, a
crash) and the OpenAPI schema that says so. Its own module, so that the request context
(context.py), which refuses a wrong API key, and the routes share it."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubesgl.contract import EMPTY_BODY, RETRY_AFTER_S, TOO_DEEP_BODY, not_json, not_served
from kubesgl.engine.messages import FinishReason
from kubesgl.engine.sampling_params import InvalidRequestError
from kubesgl.engine.server.protocol import MODEL_NAMES, UNSUPPORTED_ERROR, UTF8_ERROR

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    @classmethod
    def of(
        cls,
        reason: FinishReason,
        prompt_field: str = "prompt",
        renamed: Mapping[str, str] | None = None,
    ) -> APIError:
        """The answer to a request that ended in error; the engine calls its prompt "prompt",
        the client knows it by the field it came in (`messages`, `prompt.1`, `text`), and
        other fields by the names in `renamed` (see in_clients_words)."""
        type_ = "invalid_request_error" if reason.status < 500 else "server_error"
        message, param = in_clients_words(
            reason.message or "generation failed", reason.param, renamed
        )
        param = prompt_field if param == "prompt" else param
        return cls(reason.status, message, type_, param=param, code=reason.code)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        # OpenAI's SDKs retry a 5xx unless told not to: a 500 is this engine failing at the
        # request, which another try may break again; a 503 (loading, draining, the queue
        # full) says when to try again
        headers = {
            500: {"x-should-retry": "false"},
            503: {"retry-after": str(RETRY_AFTER_S)},
        }.get(self.status)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def in_clients_words(
    message: str, param: str | None, names: Mapping[str, str] | None
) -> tuple[str, str | None]:
    """An engine's error message and field in the names the client gave the fields `names`
    maps (the engine's output limit "max_tokens" is chat's `max_completion_tokens` where the
    client sent that). In the message only the field it starts with, and names no prose
    holds (with an underscore: `stop` may be a word, `--max-stop-string-length` a flag)."""
    names = names or {}
    if param is not None and param in names and message.startswith(f"{param} "):
        message = names[param] + message[len(param) :]
    for engine_name, client_name in names.items():
        if "_" in engine_name:
            field = rf"(?<![\w.-]){re.escape(engine_name)}(?![\w-])"
            message = re.sub(field, client_name, message)
    return message, names.get(param or "", param)


@contextlib.contextmanager
def as_bad_request(names: Mapping[str, str] | None = None) -> Iterator[None]:
    """An InvalidRequestError raised inside becomes a 400, its message and field in the client's
    words (in_clients_words: `names` maps the engine's field names to the client's)."""
    try:
        yield
    except InvalidRequestError as exc:
        message, param = in_clients_words(str(exc), exc.param, names)
        raise APIError(400, message, param=param, code=exc.code) from exc


def validation_error(errors: Sequence[dict]) -> APIError:
    """One 400 for pydantic's errors: text that is not UTF-8 first (the other members of a
    union fail on it too, less helpfully), else of the first field's errors the one that got
    deepest into the value (for a union, the member the value was meant for); the field path
    without pydantic's union-member tags (`prompt.list[int]`, `tool_choice.NamedToolChoice`),
    which are no field names."""

    def path(e: dict) -> tuple:
        return tuple(part for part in e.get("loc", ()) if part != "body")

    field = path(errors[0])[:1]
    deepest = max((e for e in errors if path(e)[:1] == field), key=lambda e: len(path(e)))
    error = next((e for e in errors if e.get("type") == UTF8_ERROR), deepest)
    if error.get("type") == "json_invalid":  # its location is a character offset, not a field
        where = error.get("loc", ("body", "?"))[-1]
        reason = (error.get("ctx") or {}).get("error", "invalid syntax")
        return APIError(400, f"the request body is not valid JSON: {reason} at character {where}")
    loc = [str(part) for part in error.get("loc", ()) if _a_field_name(part)]
    if not loc and error.get("type") == "missing":  # FastAPI's word for an empty body
        return APIError(400, EMPTY_BODY)
    if not loc and error.get("type") in ("model_type", "model_attributes_type"):  # no object
        return APIError(
            400,
            "the request body must be a JSON object (was it sent with Content-Type: "
            "application/json?)",
        )
    message = error.get("msg", "invalid request")
    if error.get("type") == "value_error":  # a validator's own message, without pydantic's prefix
        message = str((error.get("ctx") or {}).get("error", message))
    # "field: message", or "field message" for a message that reads on from the field's name
    sep = " " if error.get("type") == UNSUPPORTED_ERROR else ": "
    return APIError(
        400, f"{'.'.join(loc) + sep if loc else ''}{message}", param=".".join(loc) or None
    )


def _a_field_name(part: str | int) -> bool:
    return part != "body" and "[" not in str(part) and part not in MODEL_NAMES


ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def document_errors_as_answered(app: FastAPI) -> None:
    """FastAPI documents a bad request as a 422 with its own body; this server answers 400 with
    OpenAI's error body: say so in the served OpenAPI schema."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # FastAPI's: also keeps it as app.openapi_schema
        for operations in schema["paths"].values():
            for operation in operations.values():
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"]["400"] = {
                        "description": "Bad request (OpenAI's error body)",
                        "content": {"application/json": {"schema": ERROR_SCHEMA}},
                    }
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented customisation


def answer_errors_as_openai(app: FastAPI) -> None:
    """Every error the app answers in OpenAI's body: a body that fails validation (400, not
    FastAPI's 422), an APIError, the router's 404 and 405, a crash's 500; and the served
    OpenAPI schema says so."""
    document_errors_as_answered(app)
    # (FastAPI's exception_handler accepts handlers typed for their exception class; Starlette's
    # add_exception_handler, which it calls, is typed for Exception only)
    app.exception_handler(RequestValidationError)(_invalid)
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_crash)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors()).response()


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(
    request: Request, exc: StarletteHTTPException
) -> JSONResponse:  # unknown path, wrong method
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if isinstance(exc.__cause__, RecursionError):  # FastAPI could not even read the body
        message = TOO_DEEP_BODY
    elif isinstance(exc.__cause__, UnicodeDecodeError):  # nor decode it: say which byte
        message = not_json(exc.__cause__)
    else:
        message = _route_problem(request, exc)
    response = APIError(exc.status_code, message, type_).response()
    response.headers.update(exc.headers or {})  # a 405's Allow, which HTTP requires
    return response


def _route_problem(request: Request, exc: StarletteHTTPException) -> str:
    """In the router's words: the route that is not there, or the methods a route takes
    (Starlette's "Not Found" and "Method Not Allowed" named neither)."""
    path = request.url.path
    if exc.status_code == 404 and exc.detail == "Not Found":  # routing's, not a handler's own
        return not_served(path) or f"no route for {request.method} {path}"
    allowed = (exc.headers or {}).get("Allow")
    return f"{path} accepts {allowed}" if exc.status_code == 405 and allowed else str(exc.detail)


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("%s %s failed", request.method, request.url.path)
    return internal_error(exc).response()


def internal_error(exc: Exception) -> APIError:
    """A bug's answer: its kind, never its message (which may quote the request)."""
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error")
