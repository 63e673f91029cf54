"""A completion's prompt comes in four forms (text, texts, token ids, lists of token ids):
each parses to its own type, an error names the element at fault, and a long token-id prompt
costs what validating a list of ints costs (the plain union tried every form over the whole
list: a million ids held the event loop 0.26 s)."""

from __future__ import annotations

import time

import pytest
from pydantic import StrictInt, TypeAdapter, ValidationError

from kubesgl.engine.server.errors import validation_error
from kubesgl.engine.server.protocol import CompletionRequest


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_form_parses_to_its_prompts(prompt, prompts):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts() == prompts


@pytest.mark.parametrize(
    "prompt, param, words",
    [
        ([1, "a"], "prompt.1", "integer"),
        (["a", 1], "prompt.1", "string"),
        ([[1], ["a"]], "prompt.1.0", "integer"),
        ([1, True], "prompt.1", "integer"),
        ([[]], "prompt.0", "at least 1"),
        (["ok", "\ud800"], "prompt.1", "UTF-8"),
        (5, "prompt", "string"),
    ],
)
def test_an_error_names_the_element_at_fault(prompt, param, words):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    error = validation_error(raised.value.errors())
    assert error.param == param and words in error.message, error.message


def test_a_long_token_id_prompt_validates_as_fast_as_a_list_of_ints():
    ids = [1] * 1_000_000

    def seconds(validate) -> float:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            validate()
            best = min(best, time.perf_counter() - started)
        return best

    plain = seconds(lambda: TypeAdapter(list[StrictInt]).validate_python(ids))
    prompt = seconds(lambda: CompletionRequest.model_validate({"model": "m", "prompt": ids}))
    assert prompt < 3 * plain, (prompt, plain)  # the union of every form took 11x
