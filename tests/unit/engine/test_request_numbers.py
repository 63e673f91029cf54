"""`true` is no number, and "3" neither: a boolean or a string in any numeric field of a
request is a 400 naming that field (pydantic, like Python, would take `true` for 1, and its
lax mode "3" for 3); flags are JSON booleans; a null is the field left out."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kubesgl.engine.sampling_params import InvalidRequestError
from kubesgl.engine.server.errors import in_clients_words, validation_error
from kubesgl.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
    NativeSamplingParams,
)

BASES: dict[type[BaseModel], dict[str, Any]] = {
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    CompletionRequest: {"model": "m", "prompt": "hi"},
    GenerateRequestBody: {"text": "hi"},
}


def _numeric_fields(model: type[BaseModel]) -> list[str]:
    """The fields whose type is a number (or a union that starts with one)."""
    number = re.compile(r"(typing\.(Optional|Union)\[)?(typing\.Annotated\[|<class ')(int|float)\b")
    return [name for name, info in model.model_fields.items() if number.match(str(info.annotation))]


CASES = [(model, (name,)) for model in BASES for name in _numeric_fields(model)] + [
    (GenerateRequestBody, ("sampling_params", name))
    for name in _numeric_fields(NativeSamplingParams)
]


def _with(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**body, path[0]: value}
    return {**body, path[0]: _with(body.get(path[0], {}), path[1:], value)}


def test_the_cases_cover_the_sampling_numbers():
    names = {".".join(path) for _, path in CASES}
    assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "bootstrap_room"} <= names
    assert "sampling_params.max_new_tokens" in names


@pytest.mark.parametrize(
    "model, path", CASES, ids=[f"{model.__name__}.{'.'.join(path)}" for model, path in CASES]
)
def test_a_boolean_number_is_a_400_naming_the_field(model, path):
    with pytest.raises(ValidationError) as raised:
        model.model_validate(_with(BASES[model], path, True))
    error = validation_error(raised.value.errors())
    assert error.status == 400 and error.param == ".".join(path), error.message
    assert "not true or false" in error.message, error.message


def test_numbers_are_still_numbers():
    request = CompletionRequest.model_validate(
        {**BASES[CompletionRequest], "max_tokens": 3, "temperature": 0, "seed": 7}
    )
    assert (request.max_tokens, request.temperature, request.seed) == (3, 0.0, 7)


@pytest.mark.parametrize(
    "model, path", CASES, ids=[f"{model.__name__}.{'.'.join(path)}" for model, path in CASES]
)
def test_a_string_number_is_a_400_naming_the_field(model, path):
    with pytest.raises(ValidationError) as raised:
        model.model_validate(_with(BASES[model], path, "3"))
    error = validation_error(raised.value.errors())
    assert error.status == 400 and error.param == ".".join(path), error.message
    assert "not a string" in error.message, error.message


def _answer(model: type[BaseModel], path: tuple[str, ...], value: Any) -> str:
    """The engine's 400 message for `value` in the field at `path`, or "taken"."""
    try:
        model.model_validate(_with(BASES[model], path, value))
    except ValidationError as exc:
        return validation_error(exc.errors()).message
    return "taken"


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
@pytest.mark.parametrize(
    "model, path", CASES, ids=[f"{model.__name__}.{'.'.join(path)}" for model, path in CASES]
)
def test_a_whole_number_written_with_an_exponent_is_answered_as_that_integer(model, path, sign):
    """`1e30` is answered as the integer it is (the field's bound named, or taken): pydantic,
    which converts whole floats to int only within 64 bits, said "Unable to parse input string
    as an integer" of it, of a number."""
    assert _answer(model, path, sign * 1e30) == _answer(model, path, int(sign * 1e30))


FLAGS = [
    (ChatCompletionRequest, "stream"),
    (ChatCompletionRequest, "logprobs"),
    (ChatCompletionRequest, "parallel_tool_calls"),
    (CompletionRequest, "ignore_eos"),
    (GenerateRequestBody, "return_logprob"),
]


@pytest.mark.parametrize("model, name", FLAGS)
def test_a_flag_is_a_json_boolean(model, name):
    for value in ("yes", "true", 1):
        with pytest.raises(ValidationError) as raised:
            model.model_validate({**BASES[model], name: value})
        assert validation_error(raised.value.errors()).param == name


def test_the_stop_string_flags_reach_the_sampling_params():
    """vLLM's include_stop_str_in_output and SGLang's no_stop_trim (also in /generate's
    sampling_params) keep a matched stop string at the end of the text."""
    for flag in ("include_stop_str_in_output", "no_stop_trim"):
        request = CompletionRequest.model_validate({**BASES[CompletionRequest], flag: True})
        assert request.to_sampling_params().include_stop_str_in_output
    native = GenerateRequestBody.model_validate(
        {"text": "hi", "sampling_params": {"no_stop_trim": True}}
    )
    assert native.to_sampling_params().include_stop_str_in_output
    assert (
        not CompletionRequest.model_validate(BASES[CompletionRequest])
        .to_sampling_params()
        .include_stop_str_in_output
    )


def test_min_tokens_reach_the_sampling_params():
    """vLLM's min_tokens on the OpenAI routes, SGLang's min_new_tokens on /generate."""
    chat = ChatCompletionRequest.model_validate({**BASES[ChatCompletionRequest], "min_tokens": 3})
    assert chat.to_sampling_params().min_tokens == 3
    native = GenerateRequestBody.model_validate(
        {"text": "hi", "sampling_params": {"min_new_tokens": 4}}
    )
    assert native.to_sampling_params().min_tokens == 4


@pytest.mark.parametrize(
    "sampling, words",
    [
        ({"max_new_tokens": 3, "min_new_tokens": 5}, "must not exceed max_new_tokens (3)"),
        ({"regex": "a+", "min_new_tokens": 2}, "cannot be given with regex"),
    ],
)
def test_generate_names_its_own_fields_when_min_new_tokens_cannot_be_met(sampling, words):
    with pytest.raises(ValidationError) as raised:
        GenerateRequestBody.model_validate({"text": "hi", "sampling_params": sampling})
    error = validation_error(raised.value.errors())
    assert error.param == "sampling_params.min_new_tokens" and words in error.message


@pytest.mark.parametrize("n", [2, 64])
def test_generate_refuses_sampling_params_n_it_would_ignore(n):
    """SGLang's /generate samples n sequences; this one answers one, and said nothing."""
    with pytest.raises(ValidationError) as raised:
        GenerateRequestBody.model_validate({"text": "hi", "sampling_params": {"n": n}})
    error = validation_error(raised.value.errors())
    assert error.param == "sampling_params.n" and "one sequence per prompt" in error.message
    one = GenerateRequestBody.model_validate({"text": "hi", "sampling_params": {"n": 1}})
    assert one.sampling_params.n == 1


SEED_PATHS = [
    (ChatCompletionRequest, ("seed",)),
    (CompletionRequest, ("seed",)),
    (GenerateRequestBody, ("sampling_params", "seed")),
]


@pytest.mark.parametrize(
    "model, path", SEED_PATHS, ids=[f"{model.__name__}.{'.'.join(p)}" for model, p in SEED_PATHS]
)
@pytest.mark.parametrize(
    "seed, bound",
    [
        (2**63, "less than or equal to 9223372036854775807"),
        (10**30, "less than or equal to 9223372036854775807"),
        (1e30, "less than or equal to 9223372036854775807"),
        (-(2**63) - 1, "greater than or equal to -9223372036854775808"),
        (-1e19, "greater than or equal to -9223372036854775808"),
    ],
)
def test_a_seed_outside_64_bits_is_a_400_naming_it(model, path, seed, bound):
    """As vLLM's schema bounds it; it was taken, and sampled as its remainder modulo 2**63
    (2**63 as 0 does)."""
    with pytest.raises(ValidationError) as raised:
        model.model_validate(_with(BASES[model], path, seed))
    error = validation_error(raised.value.errors())
    assert (error.status, error.param) == (400, ".".join(path)), error.message
    assert error.message == f"{'.'.join(path)}: Input should be {bound}"


@pytest.mark.parametrize(
    "model, path", SEED_PATHS, ids=[f"{model.__name__}.{'.'.join(p)}" for model, p in SEED_PATHS]
)
def test_seeds_within_64_bits_are_taken_negative_ones_too(model, path):
    for seed in (-(2**63), -7, 0, 2**63 - 1):
        request = model.model_validate(_with(BASES[model], path, seed))
        assert request.to_sampling_params().seed == seed


def test_a_null_is_the_field_left_out():
    """`"stream": null` and the like: OpenAI allows null for its optional fields, and clients
    that forward options they were not given send it."""
    nulls = {"stream": None, "n": None, "logprobs": None, "parallel_tool_calls": None}
    chat = ChatCompletionRequest.model_validate({**BASES[ChatCompletionRequest], **nulls})
    assert (chat.stream, chat.n, chat.logprobs, chat.parallel_tool_calls) == (False, 1, False, True)
    completion = CompletionRequest.model_validate(
        {**BASES[CompletionRequest], "echo": None, "stream": None, "max_tokens": None}
    )
    assert (completion.echo, completion.stream, completion.max_tokens) == (False, False, None)
    generate = GenerateRequestBody.model_validate({"text": "hi", "sampling_params": None})
    assert generate.sampling_params.max_new_tokens == 128


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"stop": ["", "x"]}, "sampling_params.stop"),
        ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
        ({"stop": [str(i) for i in range(17)]}, "sampling_params.stop"),
    ],
)
def test_generate_errors_name_the_fields_the_client_wrote(sampling, field):
    """/generate's sampling options sit in `sampling_params`: its errors name them there, not
    as the engine's top-level fields of the OpenAI routes."""
    body = GenerateRequestBody.model_validate({"text": "hi", "sampling_params": sampling})
    with pytest.raises(InvalidRequestError) as raised:
        body.to_sampling_params().validate(vocab_size=1000)
    message, param = in_clients_words(str(raised.value), raised.value.param, body.renamed_fields())
    assert param == field and message.startswith(field), message


def test_renaming_keeps_prose_and_flags_whole():
    """Only field names are renamed: `stop` the word and `--max-stop-string-length` the flag
    stay as they are (they read "sampling_params.stop strings", "--max-sampling_params.stop...")."""
    names = GenerateRequestBody.model_validate({"text": "hi"}).renamed_fields()
    prose = "this model has no tokenizer: stop strings cannot be matched"
    assert in_clients_words(prose, "stop", names) == (prose, "sampling_params.stop")
    limit = "stop strings may be at most 8 characters long (--max-stop-string-length); one is 9"
    assert in_clients_words(limit, "stop", names) == (
        "sampling_params." + limit,
        "sampling_params.stop",
    )
