"""Tool calls read out of answers in each supported format, the format chosen from the chat
template, and streamed content held back where a call may begin."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from kubesgl.engine.sampling_params import InvalidRequestError
from kubesgl.engine.server.openai_format import _READERS, ToolOutput
from kubesgl.engine.server.protocol import ChatCompletionRequest
from kubesgl.engine.server.tool_calls import (
    FORMATS,
    ToolCall,
    ToolMode,
    format_for_template,
    named_grammar,
    parse_required,
    required_grammar,
)

QWEN, LLAMA = FORMATS
DECLARED = frozenset({"get_weather", "a", "b"})


def parse(fmt, text: str, **options) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an "auto" answer of a request whose tools declare DECLARED."""
    reading = ToolOutput("auto", format=fmt, declared=DECLARED, **options).read(text)
    return reading.content, reading.calls


def answered_both_ways(tools: ToolOutput, pieces: list[str], reason: str) -> tuple[dict, dict]:
    """The message of the whole answer, and the one a client assembles from the stream, each
    with its finish_reason and calls as (name, arguments)."""
    from kubesgl.engine.messages import FinishReason, TextOutput
    from kubesgl.engine.server.openai_format import ChatFormatter, Choice

    streamed = {"content": "", "calls": [], "finish_reason": None}
    formatter, choice = ChatFormatter({"id": "x"}, False, tools), Choice(index=0)
    for i, piece in enumerate(pieces):
        finish = FinishReason(reason, matched_token=2) if i == len(pieces) - 1 else None
        out = TextOutput("r", piece, [i], finish, 1, 0, i + 1)
        choice.add(out)
        if (chunk := formatter.chunk(choice, out)) is not None:
            (sent,) = chunk["choices"]
            streamed["content"] += sent["delta"].get("content") or ""
            streamed["calls"] += [
                (c["function"]["name"], c["function"]["arguments"])
                for c in sent["delta"].get("tool_calls", [])
            ]
            streamed["finish_reason"] = sent["finish_reason"] or streamed["finish_reason"]
    streamed["content"] = streamed["content"] or None
    (final,) = ChatFormatter({"id": "x"}, False, tools).final([choice], {})["choices"]
    whole = {
        "content": final["message"]["content"],
        "calls": [
            (c["function"]["name"], c["function"]["arguments"])
            for c in final["message"].get("tool_calls", [])
        ],
        "finish_reason": final["finish_reason"],
    }
    return whole, streamed


def test_the_format_comes_from_the_chat_template():
    assert format_for_template("... {{- '<tool_call>\\n' }} ...") is QWEN
    assert format_for_template("{%- if tools %} ... <|python_tag|> ... {%- endif %}") is LLAMA
    assert format_for_template("{{ message['content'] }}") is None
    assert format_for_template(None) is None


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [ToolCall("get_weather", '{"city": "Paris"}')],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
            '{"name": "b", "arguments": {"x": 1}}\n</tool_call>',
            "Let me look.",
            [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')],
        ),
        ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
        (
            '<tool_call>\n{"name": "a", "argu',
            '<tool_call>\n{"name": "a", "argu',
            [],
        ),  # cut short: text, no call
    ],
)
def test_qwen_tool_calls(text, content, calls):
    assert parse(QWEN, text) == (content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [ToolCall("get_weather", '{"city": "Paris"}')],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}',
            None,
            [ToolCall("a", "{}"), ToolCall("b", '{"n": 2}')],
        ),
        ("The set {1, 2} has two elements.", "The set {1, 2} has two elements.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call
        (  # JSON inside an answer is content: calls come only at its start
            'Here is the user: {"name": "Bob", "age": 3}',
            'Here is the user: {"name": "Bob", "age": 3}',
            [],
        ),
        (
            'Call it so: {"name": "a", "parameters": {}}',
            'Call it so: {"name": "a", "parameters": {}}',
            [],
        ),
        ('{"name": "Bob"}', '{"name": "Bob"}', []),  # a name without arguments is no call
        (
            '\n {"name": "a", "parameters": {"n": 1}}',
            None,
            [ToolCall("a", '{"n": 1}')],
        ),
        (
            '\n<|python_tag|>{"name": "a", "parameters": {}}',
            None,
            [ToolCall("a", "{}")],
        ),
    ],
)
def test_llama3_json_tool_calls(text, content, calls):
    assert parse(LLAMA, text) == (content, calls)


def test_a_qwen_call_needs_its_arguments():
    text = '<tool_call>\n{"name": "a"}\n</tool_call>'
    assert parse(QWEN, text) == (text, [])


def test_required_calls_follow_the_grammars_list():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    schema = json.loads(required_grammar(tools).spec)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "enum": ["f"]
    }
    assert parse_required('[{"name": "f", "parameters": {"a": 1}}]') == [ToolCall("f", '{"a": 1}')]


def test_streamed_content_is_held_where_a_call_may_begin():
    auto = ToolOutput("auto", format=QWEN, declared=DECLARED)
    assert auto.held_from("Sure, ") == len("Sure,")  # whitespace waits for text after it
    assert auto.held_from("Sure, <tool") == len("Sure,")  # maybe the marker, cut across chunks
    assert auto.held_from('Sure, <tool_call>\n{"na') == len("Sure,")
    assert ToolOutput("required").held_from("[{") == 0
    assert ToolOutput("auto").held_from("anything <tool") == len(
        "anything <tool"
    )  # no known format
    assert ToolOutput("named", name="f").read('{"x": 1}').calls == [ToolCall("f", '{"x": 1}')]


def test_an_auto_call_streams_as_delta_tool_calls_after_the_content_before_it():
    from kubesgl.engine.messages import FinishReason, TextOutput
    from kubesgl.engine.server.openai_format import ChatFormatter, Choice

    formatter = ChatFormatter(
        {"id": "x"}, False, ToolOutput("auto", format=QWEN, declared=DECLARED)
    )
    choice, chunks = Choice(index=0), []
    pieces = [
        "Sure, ",
        "<tool",
        '_call>\n{"name": "a", "argu',
        'ments": {"k": 1}}\n</tool_call>',
        "",
    ]
    for i, piece in enumerate(pieces):
        reason = FinishReason("stop", matched_token=2) if i == len(pieces) - 1 else None
        out = TextOutput("r", piece, [i], reason, 1, 0, i + 1)
        choice.add(out)
        chunks.append(formatter.chunk(choice, out))
    assert chunks[1:3] == [None, None]  # "<tool" held back, and the call: nothing to send yet
    deltas = [c["choices"][0] for c in chunks if c is not None]
    assert [d["delta"].get("content") for d in deltas] == ["Sure,", None]
    last = deltas[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert (call["index"], call["function"]) == (0, {"name": "a", "arguments": '{"k": 1}'})
    assert all("tool_calls" not in d["delta"] for d in deltas[:-1])


def test_streamed_text_that_holds_no_call_is_all_sent_by_the_end():
    from kubesgl.engine.messages import FinishReason, TextOutput
    from kubesgl.engine.server.openai_format import ChatFormatter, Choice

    formatter = ChatFormatter(
        {"id": "x"}, False, ToolOutput("auto", format=QWEN, declared=DECLARED)
    )
    choice, sent = Choice(index=0), ""
    for i, piece in enumerate(["a < b, ", "and <tool", "box> too"]):
        out = TextOutput("r", piece, [i], FinishReason("length") if i == 2 else None, 1, 0, i + 1)
        choice.add(out)
        if (chunk := formatter.chunk(choice, out)) is not None:
            sent += chunk["choices"][0]["delta"].get("content", "")
    assert sent == "a < b, and <toolbox> too"


def test_llama3_json_holds_back_only_the_start_of_an_answer():
    auto = ToolOutput("auto", format=LLAMA)
    assert auto.held_from('Here is the user: {"na') == len('Here is the user: {"na')
    assert auto.held_from(' {"na') == 0
    assert auto.held_from("<|pyth") == 0  # maybe the marker, cut across chunks
    assert auto.held_from("\n") == 0  # a call may still come
    assert auto.held_from("Sure") == len("Sure")


QWEN_CALL = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'


def test_an_auto_call_of_a_function_the_tools_do_not_declare_is_content():
    """As SGLang, an undeclared function is never returned as a call; here the whole answer
    is then text (nothing of it lost), streamed or not."""
    text = "Let me see.\n" + QWEN_CALL.format("get_weather") + "\n" + QWEN_CALL.format("rm")
    assert parse(QWEN, text) == (text, [])
    tools = ToolOutput("auto", format=QWEN, declared=DECLARED)
    whole, streamed = answered_both_ways(tools, [text[:20], text[20:]], "stop")
    assert whole == streamed == {"content": text, "calls": [], "finish_reason": "stop"}


def test_without_parallel_calls_an_auto_answer_gives_its_first_call_only():
    text = QWEN_CALL.format("a") + "\n" + QWEN_CALL.format("b")
    assert parse(QWEN, text, parallel=False) == (None, [ToolCall("a", "{}")])
    tools = ToolOutput("auto", format=QWEN, declared=DECLARED, parallel=False)
    whole, streamed = answered_both_ways(tools, [text[:30], text[30:]], "stop")
    assert (
        whole
        == streamed
        == {"content": None, "calls": [("a", "{}")], "finish_reason": "tool_calls"}
    )


@pytest.mark.parametrize("before", ["Sure. ", "Sure.\n\n", "\n", "  Sure, let me look.  "])
def test_the_content_before_a_call_is_the_same_streamed_or_not(before):
    """Whitespace between the content and a call is cut in both (the stream holds it back until
    text follows)."""
    text = before + QWEN_CALL.format("a")
    tools = ToolOutput("auto", format=QWEN, declared=DECLARED)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    whole, streamed = answered_both_ways(tools, pieces, "stop")
    assert whole == streamed, (whole, streamed)
    assert whole["content"] == (before.rstrip() or None)


@pytest.mark.parametrize(
    "second",
    [QWEN_CALL.format("rm"), '<tool_call>\n{"name": "b", "argu'],
    ids=["undeclared", "cut-by-max-tokens"],
)
def test_without_parallel_calls_the_calls_after_the_first_decide_nothing(second):
    """Only the first call is given, so what follows it (a call to an undeclared function, a
    call cut short) cannot turn the answer into text."""
    text = QWEN_CALL.format("a") + "\n" + second
    assert parse(QWEN, text, parallel=False) == (None, [ToolCall("a", "{}")])
    assert parse(QWEN, text) == (text, [])


def test_required_calls_cut_by_max_tokens_keep_the_whole_ones_and_a_named_last_one():
    whole = '{"name": "a", "parameters": {"x": 1}}'
    assert parse_required(f'[{whole}, {{"name": "get_weather", "parameters": {{"city": "du') == [
        ToolCall("a", '{"x": 1}'),
        ToolCall("get_weather", '{"city": "du'),
    ]
    assert parse_required(f'[{whole},{{"name":"b","para') == [
        ToolCall("a", '{"x": 1}'),
        ToolCall("b", ""),
    ]
    assert parse_required(f'[{whole}, {{"name": "get_w') == [ToolCall("a", '{"x": 1}')]
    assert parse_required('[{"na') == []


@pytest.mark.parametrize(
    "tools, text, calls",
    [
        (
            ToolOutput("named", name="get_weather"),
            '{"city": "dules',
            [("get_weather", '{"city": "dules')],
        ),
        (
            ToolOutput("required"),
            '[{"name": "get_weather", "parameters": {"city": "Par',
            [("get_weather", '{"city": "Par')],
        ),
    ],
)
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(tools, text, calls):
    """As vLLM: with finish_reason "length"; the JSON list around the calls is no content."""
    whole, streamed = answered_both_ways(tools, [text[:7], text[7:]], "length")
    assert whole == streamed == {"content": None, "calls": calls, "finish_reason": "length"}


@pytest.mark.parametrize("text", ['[{"name": "get_', "[", '[{"na'])
def test_a_required_answer_cut_before_its_first_call_keeps_its_text_as_content(text):
    """No call could be read from it: its text was dropped (content null, no tool_calls),
    streamed or not; it is the content now, as SGLang answers it."""
    whole, streamed = answered_both_ways(ToolOutput("required"), [text[:2], text[2:]], "length")
    assert whole == streamed == {"content": text, "calls": [], "finish_reason": "length"}


DEEP = "[" * 1100  # past the depth Python's JSON reader can read: RecursionError, not ValueError


@pytest.mark.parametrize(
    "fmt, text",
    [
        (QWEN, "<tool_call>" + DEEP),
        (QWEN, '<tool_call>\n{"name": "a", "arguments": ' + DEEP),
        (LLAMA, '{"name": "a", "parameters": ' + DEEP),
        (LLAMA, '{"name": "a", "parameters": {}}; ' + DEEP),
    ],
    ids=["qwen-block", "qwen-arguments", "llama3-first", "llama3-second"],
)
def test_an_auto_call_nested_too_deeply_to_read_is_text(fmt, text):
    """As any call that cannot be read: the whole answer is the content, streamed or not
    (the reader's RecursionError was a 500 after the whole generation, and cut the stream)."""
    assert parse(fmt, text) == (text, [])
    tools = ToolOutput("auto", format=fmt, declared=DECLARED)
    whole, streamed = answered_both_ways(tools, [text[:5], text[5:]], "length")
    assert whole == streamed == {"content": text, "calls": [], "finish_reason": "length"}


def test_a_required_call_nested_too_deeply_to_read_is_one_cut_short():
    """Read as far as it can be: its name, and its arguments as the model wrote them."""
    whole = '{"name": "a", "parameters": {"x": 1}}'
    assert parse_required(f'[{whole}, {{"name": "b", "parameters": {DEEP}') == [
        ToolCall("a", '{"x": 1}'),
        ToolCall("b", DEEP),
    ]
    assert parse_required("[" + DEEP) == []


def test_every_tool_mode_has_a_reader():
    assert set(_READERS) == set(get_args(ToolMode))


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def chat_with(**fields) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


@pytest.mark.parametrize(
    "fields, mode, grammar",
    [
        ({}, "none", None),
        ({"tools": [WEATHER], "tool_choice": "none"}, "none", None),
        ({"tools": [WEATHER]}, "auto", None),
        ({"tools": [WEATHER], "tool_choice": "required"}, "required", required_grammar([WEATHER])),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "named",
            named_grammar(WEATHER),
        ),
    ],
)
def test_tool_choice_gives_its_mode_and_grammar(fields, mode, grammar):
    choice = chat_with(**fields).tool_mode()
    assert choice.mode == mode and choice.grammar(parallel=True) == grammar
    # the template is shown the tools unless tool_choice is "none"
    assert choice.template_tools == (None if mode == "none" else [WEATHER])


def test_a_named_tool_choice_carries_its_tool():
    other = {"type": "function", "function": {"name": "other"}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat_with(tools=[other, WEATHER], tool_choice=named).tool_mode()
    assert choice.named == WEATHER


def test_required_without_parallel_calls_allows_one_call():
    choice = chat_with(tools=[WEATHER], tool_choice="required").tool_mode()
    assert choice.grammar(parallel=False) == required_grammar([WEATHER], parallel=False)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice names 'x', which is not in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "regex": "a+"},
            "regex and a required or named tool_choice cannot both constrain the answer",
        ),
    ],
)
def test_a_tool_choice_its_tools_cannot_meet_is_refused(fields, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        chat_with(**fields).tool_mode()
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize(
    "tools, text, finish",
    [
        # OpenAI's answers (vLLM's too): a forced named function ends as any answer, "stop"
        (ToolOutput("named", name="a"), '{"k": 1}', "stop"),
        (ToolOutput("required"), '[{"name": "a", "parameters": {"k": 1}}]', "tool_calls"),
        (ToolOutput("auto", format=QWEN, declared=DECLARED), QWEN_CALL.format("a"), "tool_calls"),
    ],
)
def test_the_finish_reason_of_an_answer_of_calls_is_openais(tools, text, finish):
    whole, streamed = answered_both_ways(tools, [text[:5], text[5:]], "stop")
    assert whole["calls"] and whole == streamed
    assert whole["finish_reason"] == finish
