"""vLLM's and SGLang's control of the chat template on /v1/chat/completions:
add_generation_prompt, continue_final_message and chat_template_kwargs reach the template
(they were taken and ignored); what cannot work together is a 400 naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubesgl.engine import SamplingParams
from kubesgl.engine.messages import TokenizeRequest
from kubesgl.engine.server.errors import validation_error
from kubesgl.engine.server.protocol import ChatCompletionRequest
from kubesgl.engine.tokenizer.process import Tokenizer, TokenizerError

CONVERSATION = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "It is"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer(tiny_model("llama"))


def prompt(tokenizer, messages=CONVERSATION, **options) -> str:
    ids = tokenizer.encode(TokenizeRequest("r", SamplingParams(), messages=messages, **options))
    return tokenizer.hf.decode(ids)


def test_the_prompt_opens_the_assistants_turn_unless_asked_not_to(tokenizer):
    assert prompt(tokenizer).endswith("It is<|im_end|>\n<|im_start|>assistant\n")
    assert prompt(tokenizer, add_generation_prompt=False).endswith("It is<|im_end|>\n")


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    opened = prompt(tokenizer, add_generation_prompt=False, continue_final_message=True)
    assert opened.endswith("<|im_start|>assistant\nIt is")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    thinking_off = prompt(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(tokenizer, chat_template_kwargs={"enable_thinking": True}) == prompt(tokenizer)


@pytest.mark.parametrize(
    "key", ["tools", "messages", "add_generation_prompt", "tokenize", "chat_template"]
)
def test_chat_template_kwargs_may_not_set_what_the_server_sets(tokenizer, key):
    with pytest.raises(TokenizerError) as raised:
        prompt(tokenizer, chat_template_kwargs={key: None, "enable_thinking": False})
    assert raised.value.param == "chat_template_kwargs" and repr(key) in str(raised.value)


@pytest.mark.parametrize(
    "messages, body, words",
    [
        (
            CONVERSATION,
            {"continue_final_message": True},
            "continue_final_message and add_generation_prompt cannot both be true",
        ),
        (
            CONVERSATION[:1],
            {"continue_final_message": True, "add_generation_prompt": False},
            "needs the last message to be the assistant's, got user",
        ),
    ],
)
def test_continue_final_message_is_refused_where_it_cannot_work(messages, body, words):
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": messages, **body})
    error = validation_error(raised.value.errors())
    assert error.status == 400 and error.param == "continue_final_message"
    assert words in error.message


def test_the_options_are_read_with_vllms_defaults():
    default = ChatCompletionRequest.model_validate({"messages": CONVERSATION})
    assert default.add_generation_prompt and not default.continue_final_message
    assert default.chat_template_kwargs is None
    continued = ChatCompletionRequest.model_validate(
        {
            "messages": CONVERSATION,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert continued.continue_final_message and not continued.add_generation_prompt
    assert continued.chat_template_kwargs == {"enable_thinking": False}
