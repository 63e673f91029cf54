"""What a chat message must hold, as OpenAI requires it: content (an assistant may give tool
calls instead), never an empty list of parts, and a tool's answer names its call. These
were taken, each rendered as an empty message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubesgl.engine.server.api import chat_chars
from kubesgl.engine.server.errors import validation_error
from kubesgl.engine.server.protocol import ChatCompletionRequest

CALL = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "user"}, "user messages need content"),
        ({"role": "user", "content": None}, "user messages need content"),
        ({"role": "assistant"}, "assistant messages need content or tool_calls"),
        ({"role": "user", "content": []}, "empty list of parts"),
        ({"role": "tool", "content": "sunny"}, "tool messages need tool_call_id"),
    ],
)
def test_an_incomplete_message_is_a_400_naming_it(message, words):
    messages = [{"role": "system", "content": "be brief"}, message]
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": messages})
    error = validation_error(raised.value.errors())
    assert error.status == 400 and error.param == "messages.1" and words in error.message


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_a_part_that_is_not_text_is_refused_in_words_that_say_so(part):
    """A client sending an image to a text model learns that the server takes no images, not
    that a field "should be 'text'"."""
    message = {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": [message]})
    error = validation_error(raised.value.errors())
    assert error.status == 400 and error.param == "messages.0.content.1.type"
    assert f"{part['type']} content is not supported by this server" in error.message


def test_complete_messages_are_taken():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            ]
        }
    )
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]


def test_a_message_name_reaches_the_template_and_counts_toward_its_characters():
    """OpenAI's participant name, which vLLM hands its chat templates, was dropped: a template
    that writes it (to tell two users apart) never saw it."""
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "name": "alice"}]}
    )
    (message,) = [m.as_template_input() for m in request.messages]
    assert message["name"] == "alice"
    assert chat_chars([message], None, None) == len("hi") + len("alice")


def test_a_tool_call_id_counts_toward_the_prompts_characters():
    """A template may write it, and it was not counted: a long one passed the character limit
    and was tokenized, as the limit exists to prevent."""
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "tool", "content": "sunny", "tool_call_id": "c" * 1000}]}
    )
    messages = [m.as_template_input() for m in request.messages]
    assert chat_chars(messages, None, None) == len("sunny") + 1000
