"""SamplingParams built in Python (the offline LLM API) gets the same checks the server's
request models give: a wrong type is an InvalidRequestError naming the field, never a
TypeError from deep inside a step, and one bad request never breaks the engine."""

from __future__ import annotations

import pytest

from kubesgl.engine.sampling_params import GrammarSpec, InvalidRequestError, SamplingParams


def test_a_stop_string_alone_is_one_stop_string():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("top_p", None),
        ("top_k", 2.5),
        ("min_p", "0"),
        ("seed", 1.5),
        ("seed", True),
        ("max_tokens", True),
        ("logprobs", 1.0),
        ("repetition_penalty", "1"),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 5),
        ("stop", [1]),
        ("ignore_eos", "yes"),
        ("grammar", GrammarSpec("json_schema", {"type": "object"})),  # type: ignore[arg-type]
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(vocab_size=1000)
    assert caught.value.param in (field, "response_format")


@pytest.mark.parametrize(
    "params, words",
    [
        (SamplingParams(min_tokens=-1), "non-negative"),
        (SamplingParams(min_tokens=1.5), "integer"),  # type: ignore[arg-type]
        (SamplingParams(max_tokens=4, min_tokens=5), "must not exceed max_tokens"),
        (SamplingParams(min_tokens=2, grammar=GrammarSpec("regex", "a+")), "grammar"),
    ],
)
def test_min_tokens_is_checked(params, words):
    with pytest.raises(InvalidRequestError, match=words) as caught:
        params.validate(vocab_size=1000)
    assert caught.value.param == "min_tokens"


def test_ints_pass_where_floats_are_asked_for():
    SamplingParams(temperature=0, top_p=1, repetition_penalty=1, presence_penalty=0).validate(10)
