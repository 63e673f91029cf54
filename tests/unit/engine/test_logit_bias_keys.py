"""OpenAI's logit_bias keys are token ids as text: every key is checked where the request is
validated, so a bad one is a 400 naming logit_bias, never an error (a 500) later, when the
keys become ids."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kubesgl.engine.server.errors import validation_error
from kubesgl.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
)

REQUESTS: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        "logit_bias",
    ),
    (CompletionRequest, {"model": "m", "prompt": "hi"}, "logit_bias"),
    (GenerateRequestBody, {"text": "hi"}, "sampling_params.logit_bias"),
]
ROUTES = ["chat", "completions", "generate"]


def _with_bias(base: dict[str, Any], param: str, bias: dict[str, Any]) -> dict[str, Any]:
    if param.startswith("sampling_params."):
        return {**base, "sampling_params": {"logit_bias": bias}}
    return {**base, "logit_bias": bias}


def _refusal(model: type[BaseModel], body: dict[str, Any]):
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    return validation_error(raised.value.errors())


@pytest.mark.parametrize("model, base, param", REQUESTS, ids=ROUTES)
@pytest.mark.parametrize(
    "key",
    ["9" * 4301, "1" * 20, "9" * 19, "0" * 30 + "1" * 20],
    ids=["4301-digits", "20-digits", "beyond-int64", "20-digits-after-zeros"],
)
def test_a_key_too_long_for_a_token_id_is_a_400(model, base, param, key):
    """Python's int() refuses more than 4300 digits: such a key was a 500 once it became an id."""
    error = _refusal(model, _with_bias(base, param, {key: 1}))
    assert error.status == 400 and error.param == param
    assert "keys must be token ids" in error.message
    assert len(error.message) < 200  # the key is not repeated in full


@pytest.mark.parametrize("model, base, param", REQUESTS, ids=ROUTES)
def test_a_token_named_twice_is_a_400(model, base, param):
    error = _refusal(model, _with_bias(base, param, {"7": 1, "007": -1}))
    assert error.status == 400 and error.param == param
    assert "token 7 is named twice" in error.message


@pytest.mark.parametrize("model, base, param", REQUESTS, ids=ROUTES)
def test_keys_become_token_ids(model, base, param):
    request = model.model_validate(_with_bias(base, param, {"007": 1.5, "0": -100, "42": 100}))
    assert request.to_sampling_params().logit_bias  # type: ignore[attr-defined] == {7: 1.5, 0: -100, 42: 100}


@pytest.mark.parametrize("model, base, param", REQUESTS, ids=ROUTES)
@pytest.mark.parametrize("amount", [101, "1", None], ids=["out-of-range", "a-string", "null"])
def test_a_bad_amount_is_a_400_naming_its_key(model, base, param, amount):
    """As docs/server.md says: param is the path to the bad value, as for any other field."""
    error = _refusal(model, _with_bias(base, param, {"7": amount}))
    assert error.status == 400 and error.param == f"{param}.7"
