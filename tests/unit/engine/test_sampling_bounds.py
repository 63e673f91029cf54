"""One table of sampling limits, SAMPLING_BOUNDS: the engine's validate and every route's
request body hold a value to the same bounds, each route under its own name for the field
(a value past one is a 400 naming the field as the client wrote it). The one limit of a
route's own is OpenAI's cap of 2 on temperature: /generate takes a hotter one, as SGLang's
does."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kubesgl.bounds import Bounds
from kubesgl.engine.sampling_params import SAMPLING_BOUNDS, InvalidRequestError, SamplingParams
from kubesgl.engine.server.errors import validation_error
from kubesgl.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
COMPLETION = {"model": "m", "prompt": "hi"}
GENERATE = {"text": "hi", "return_logprob": True}
# the engine's fields the OpenAI routes set under the engine's own names
OPENAI_NAMES = [name for name in SAMPLING_BOUNDS if name != "logprobs"]

# (a route's body, a valid one, the path of a field in it, the engine's field it sets)
ROUTE_FIELDS: list[tuple[type[BaseModel], dict[str, Any], tuple[str, ...], str]] = [
    *[(ChatCompletionRequest, CHAT, (name,), name) for name in OPENAI_NAMES],
    (ChatCompletionRequest, CHAT, ("max_completion_tokens",), "max_tokens"),
    (ChatCompletionRequest, CHAT, ("top_logprobs",), "logprobs"),
    *[(CompletionRequest, COMPLETION, (name,), name) for name in OPENAI_NAMES],
    (CompletionRequest, COMPLETION, ("logprobs",), "logprobs"),
    *[
        (GenerateRequestBody, GENERATE, ("sampling_params", name), name)
        for name in OPENAI_NAMES
        if name not in ("max_tokens", "min_tokens")
    ],
    (GenerateRequestBody, GENERATE, ("sampling_params", "max_new_tokens"), "max_tokens"),
    (GenerateRequestBody, GENERATE, ("sampling_params", "min_new_tokens"), "min_tokens"),
    (GenerateRequestBody, GENERATE, ("top_logprobs_num",), "logprobs"),
]
IDS = [f"{model.__name__}.{'.'.join(path)}" for model, _, path, _ in ROUTE_FIELDS]


def _with(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**body, path[0]: value}
    return {**body, path[0]: _with(body.get(path[0], {}), path[1:], value)}


def _past(bounds: Bounds) -> list[float]:
    """A value just past each of the limits."""
    below = (
        [bounds.ge - 1] if bounds.ge is not None else [bounds.gt] if bounds.gt is not None else []
    )
    above = (
        [bounds.le + 1] if bounds.le is not None else [bounds.lt] if bounds.lt is not None else []
    )
    return below + above


def _inclusive(bounds: Bounds) -> list[float]:
    return [limit for limit in (bounds.ge, bounds.le) if limit is not None]


def test_every_route_sets_every_bounded_field():
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequestBody):
        engine_names = {name for m, _, _, name in ROUTE_FIELDS if m is model}
        assert engine_names == set(SAMPLING_BOUNDS), model.__name__


@pytest.mark.parametrize("model, base, path, engine_name", ROUTE_FIELDS, ids=IDS)
def test_a_value_past_a_limit_is_refused_by_the_route_and_the_engine(
    model, base, path, engine_name
):
    for value in _past(SAMPLING_BOUNDS[engine_name]):
        with pytest.raises(InvalidRequestError) as refused:
            SamplingParams(**{engine_name: value}).validate(vocab_size=1000)
        assert refused.value.param == engine_name
        with pytest.raises(ValidationError) as raised:
            model.model_validate(_with(base, path, value))
        error = validation_error(raised.value.errors())
        assert (error.status, error.param) == (400, ".".join(path)), error.message


@pytest.mark.parametrize("model, base, path, engine_name", ROUTE_FIELDS, ids=IDS)
def test_the_limits_themselves_are_taken(model, base, path, engine_name):
    for value in _inclusive(SAMPLING_BOUNDS[engine_name]):
        params = model.model_validate(_with(base, path, value)).to_sampling_params()
        assert getattr(params, engine_name) == value
        params.validate(vocab_size=1000)


def test_the_engine_names_its_limits():
    with pytest.raises(InvalidRequestError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0).validate(vocab_size=1000)
    with pytest.raises(InvalidRequestError, match=r"^temperature must be non-negative, got -1$"):
        SamplingParams(temperature=-1).validate(vocab_size=1000)


@pytest.mark.parametrize(
    "model, base", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)]
)
def test_the_openai_routes_cap_temperature_at_2(model, base):
    assert model.model_validate({**base, "temperature": 2}).temperature == 2
    with pytest.raises(ValidationError) as raised:
        model.model_validate({**base, "temperature": 2.5})
    assert validation_error(raised.value.errors()).message == (
        "temperature: Input should be less than or equal to 2"
    )


def test_generate_takes_a_temperature_above_2_as_sglang_does():
    body = GenerateRequestBody.model_validate({**GENERATE, "sampling_params": {"temperature": 2.5}})
    body.to_sampling_params().validate(vocab_size=1000)


def test_generate_refuses_a_penalty_past_2_while_reading_the_body():
    """It was refused only once the engine's validate saw it (same status and field)."""
    with pytest.raises(ValidationError) as raised:
        GenerateRequestBody.model_validate({**GENERATE, "sampling_params": {"presence_penalty": 3}})
    assert validation_error(raised.value.errors()).message == (
        "sampling_params.presence_penalty: Input should be less than or equal to 2"
    )


def test_top_k_none_is_a_wrong_type_not_a_crash():
    with pytest.raises(InvalidRequestError, match="top_k must be an integer, got None"):
        SamplingParams(top_k=None).validate(vocab_size=1000)  # type: ignore[arg-type]
