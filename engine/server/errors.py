"""The server's error answers: OpenAI's error body, and an engine error in the words of the
client's request. Its own module, so that the request context (context.py), which refuses a
wrong API key, and the routes share it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

from fastapi.responses import JSONResponse

from kubesgl.contract import RETRY_AFTER_S
from kubesgl.engine.messages import FinishReason
from kubesgl.engine.sampling_params import InvalidRequestError


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
        return cls(reason.status, message, type_, param=param)

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
        raise APIError(400, message, param=param) from exc
