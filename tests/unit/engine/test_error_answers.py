"""What an error answer tells OpenAI's SDKs beside its body: a 500 is not to be retried."""

from __future__ import annotations

from kubesgl.engine.messages import FinishReason
from kubesgl.engine.server.api import APIError


def test_a_500_tells_the_sdk_not_to_retry_and_other_errors_leave_it_to_the_sdk():
    """The SDKs retry 5xx by default: a request that broke this engine could break it again."""
    failed = APIError.of(FinishReason("error", message="scheduler died", status=500))
    assert failed.response().headers["x-should-retry"] == "false"
    assert (
        "x-should-retry" not in APIError(503, "loading", "service_unavailable").response().headers
    )
    assert "x-should-retry" not in APIError(400, "bad").response().headers
