"""`LLM.generate` takes its arguments in the forms users of vLLM and SGLang write them, and
refuses any other with an error that says what it expected."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kubesgl.engine.sampling_params import SamplingParams


@pytest.fixture
def llm(tiny_model, make_llm):
    return make_llm(tiny_model("llama"))


def test_one_string_or_one_token_list_is_one_prompt(llm):
    [by_text] = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0))
    [by_ids] = llm.generate(by_text.prompt_token_ids, SamplingParams(max_tokens=3, temperature=0))
    assert by_ids.token_ids == by_text.token_ids and len(by_text.token_ids) == 3


def test_sampling_params_as_a_dict_as_sglang_takes_them(llm):
    prompts = [[5, 6, 7], [8, 9]]
    as_objects = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    as_dict = llm.generate(prompts, {"max_tokens": 4, "temperature": 0})
    per_prompt = llm.generate(prompts, [{"max_tokens": 4, "temperature": 0}, {"max_tokens": 2}])
    assert [o.token_ids for o in as_dict] == [o.token_ids for o in as_objects]
    assert [len(o.token_ids) for o in per_prompt] == [4, 2]


def test_sglang_option_names_are_taken_as_they_are(llm):
    """SGLang's Engine.generate takes max_new_tokens, no_stop_trim, and regex, json_schema and
    ebnf for constrained output: a script written for it runs here unchanged."""
    prompts = [[5, 6, 7]]
    ours = llm.generate(prompts, {"max_tokens": 4, "temperature": 0})
    sglang = llm.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
    assert [o.token_ids for o in sglang] == [o.token_ids for o in ours]
    [digits] = llm.generate("a", {"max_new_tokens": 6, "regex": "[0-9]{3}", "temperature": 0})
    assert digits.text.isdigit() and len(digits.text) == 3
    full = llm.generate("a", {"max_new_tokens": 8, "temperature": 0})[0].text
    stop = full[2:4]
    for trim, text in ((False, full[: full.index(stop)]), (True, full[: full.index(stop) + 2])):
        options = {"max_new_tokens": 8, "temperature": 0, "stop": stop, "no_stop_trim": trim}
        assert llm.generate("a", options)[0].text == text
    with pytest.raises(TypeError, match="max_tokens or SGLang's max_new_tokens, not both"):
        llm.generate(prompts, {"max_tokens": 4, "max_new_tokens": 4})
    with pytest.raises(TypeError, match="at most one output constraint"):
        llm.generate(prompts, {"regex": "a", "ebnf": 'root ::= "a"'})


def test_an_unknown_sampling_option_is_named(llm):
    with pytest.raises(TypeError, match=r"unknown sampling option.*'max_new_tokenz'.*max_tokens"):
        llm.generate([[5, 6]], {"max_new_tokenz": 4})


@pytest.mark.parametrize(
    "prompts, params, words",
    [
        ([[5, 6]], 4, "SamplingParams or a dict"),
        ([[5, 6]], [4], "SamplingParams or a dict"),
        ([5.0], None, "a string or a list of token ids"),
        ([[5, "6"]], None, "a string or a list of token ids"),
        (None, None, "a string or a list of token ids"),
    ],
)
def test_other_forms_are_refused_with_what_was_expected(llm, prompts, params, words):
    with pytest.raises(TypeError, match=words):
        llm.generate(prompts, params)


def test_a_result_ends_in_plain_values_as_vllm_users_expect(llm):
    """vLLM's finish_reason is a str: `out.finish_reason == "length"` was False here (a
    FinishReason object, which pydantic and dataclasses.asdict wrote as an object)."""
    greedy = {"temperature": 0, "ignore_eos": True}
    [out] = llm.generate("hello", {"max_tokens": 2, **greedy})
    assert out.finish_reason == "length" and out.stop_reason is None
    assert json.loads(json.dumps(dataclasses.asdict(out)))["finish_reason"] == "length"
    [by_token] = llm.generate(
        "hello", {"max_tokens": 8, "stop_token_ids": out.token_ids[:1], **greedy}
    )
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", out.token_ids[0])
    assert by_token.finish_message is None
