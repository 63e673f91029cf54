"""Tool calls read out of answers in each supported format, the format chosen from the chat
template, and streamed content held back where a call may begin."""

from __future__ import annotations

import json

import pytest

from kubesgl.engine.server.openai_format import ToolOutput
from kubesgl.engine.server.tool_calls import (
    FORMATS,
    ToolCall,
    format_for_template,
    parse_required,
    required_grammar,
)

QWEN, LLAMA = FORMATS


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
    assert QWEN.parse(text) == (content, calls)


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
    ],
)
def test_llama3_json_tool_calls(text, content, calls):
    assert LLAMA.parse(text) == (content, calls)


def test_a_qwen_call_needs_its_arguments():
    text = '<tool_call>\n{"name": "a"}\n</tool_call>'
    assert QWEN.parse(text) == (text, [])


def test_required_calls_follow_the_grammars_list():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    schema = json.loads(required_grammar(tools).spec)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "enum": ["f"]
    }
    assert parse_required('[{"name": "f", "parameters": {"a": 1}}]') == [ToolCall("f", '{"a": 1}')]


def test_streamed_content_is_held_where_a_call_may_begin():
    auto = ToolOutput("auto", format=QWEN)
    assert auto.held_from("Sure, ") == len("Sure, ")
    assert auto.held_from("Sure, <tool") == len("Sure, ")  # maybe the marker, cut across chunks
    assert auto.held_from('Sure, <tool_call>\n{"na') == len("Sure, ")
    assert ToolOutput("required").held_from("[{") == 0
    assert ToolOutput("auto").held_from("anything <tool") == len(
        "anything <tool"
    )  # no known format
    assert ToolOutput("named", name="f").split('{"x": 1}') == (None, [ToolCall("f", '{"x": 1}')])


def test_an_auto_call_streams_as_delta_tool_calls_after_the_content_before_it():
    from kubesgl.engine.messages import FinishReason, TextOutput
    from kubesgl.engine.server.openai_format import Choice, chat_formatter

    formatter = chat_formatter({"id": "x"}, False, ToolOutput("auto", format=QWEN))
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
    assert [d["delta"].get("content") for d in deltas] == ["Sure, ", None]
    last = deltas[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert (call["index"], call["function"]) == (0, {"name": "a", "arguments": '{"k": 1}'})
    assert all("tool_calls" not in d["delta"] for d in deltas[:-1])


def test_streamed_text_that_holds_no_call_is_all_sent_by_the_end():
    from kubesgl.engine.messages import FinishReason, TextOutput
    from kubesgl.engine.server.openai_format import Choice, chat_formatter

    formatter = chat_formatter({"id": "x"}, False, ToolOutput("auto", format=QWEN))
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
