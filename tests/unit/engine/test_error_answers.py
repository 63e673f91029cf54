"""What an error answer tells OpenAI's SDKs beside its body: a 500 is not to be retried; and
what a 400 says of a body that is no JSON object."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient

from kubesgl.engine.messages import FinishReason
from kubesgl.engine.server.errors import APIError, validation_error
from kubesgl.engine.server.protocol import CompletionRequest


def test_a_500_tells_the_sdk_not_to_retry_and_other_errors_leave_it_to_the_sdk():
    """The SDKs retry 5xx by default: a request that broke this engine could break it again."""
    failed = APIError.of(FinishReason("error", message="scheduler died", status=500))
    assert failed.response().headers["x-should-retry"] == "false"
    assert (
        "x-should-retry" not in APIError(503, "loading", "service_unavailable").response().headers
    )
    assert "x-should-retry" not in APIError(400, "bad").response().headers


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the request body is empty: send a JSON object"),
        (b"null", "the request body must be a JSON object"),
        (b"[]", "the request body must be a JSON object"),
    ],
)
def test_a_body_that_is_no_object_is_named_as_such(content, message):
    """FastAPI reports an empty body as its `body` field missing: the 400 said only 'Field
    required', with no field named."""
    app = FastAPI()
    app.exception_handler(RequestValidationError)(
        lambda _, exc: validation_error(exc.errors()).response()
    )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> None:
        raise AssertionError("no such body is valid")

    answer = TestClient(app).post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(message)
    assert answer.json()["error"]["param"] is None
