"""vLLM's and SGLang's request fields that would change the answer and that this server does
not implement: refused with a 400 naming the field, not ignored (served without them, the
client got another answer than it asked for and no sign of it). Their no-op values pass, as
clients send defaults. (OpenAI's own such fields: tests/integration/engine/test_openai_server.py.)"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubesgl.engine.server.protocol import (
    UNSUPPORTED_ERROR,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequestBody,
)

CHAT = {"messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"prompt": "x"}
GENERATE = {"text": "x"}


def _refused_at(model, body: dict) -> tuple:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    (error,) = caught.value.errors()
    assert error["type"] == UNSUPPORTED_ERROR, error
    return error["loc"]


@pytest.mark.parametrize(
    ("field", "value", "no_op"),
    [
        ("bad_words", ["Paris"], []),  # vLLM
        ("allowed_token_ids", [1, 2], None),  # vLLM
        ("use_beam_search", True, False),  # vLLM
        ("truncate_prompt_tokens", 8, None),  # vLLM
        ("stop_regex", "[0-9]", None),  # SGLang
        ("lora_path", "adapter", None),  # SGLang
        ("return_tokens_as_token_ids", True, False),  # vLLM
        ("return_token_ids", True, False),  # vLLM
        ("return_hidden_states", True, False),  # SGLang
        ("prompt_logprobs", 0, None),  # vLLM: 0 still asks for each prompt token's own
        ("length_penalty", 0.5, 1.0),  # vLLM
        ("spaces_between_special_tokens", False, True),  # vLLM
        ("logits_processors", ["m.Processor"], []),  # vLLM
        ("priority", 5, 0),  # vLLM, SGLang
        ("cache_salt", "tenant-a", None),  # vLLM
        ("kv_transfer_params", {"do_remote_decode": True}, None),  # vLLM
        ("vllm_xargs", {"k": 1}, {}),  # vLLM
    ],
)
@pytest.mark.parametrize(
    ("model", "base"), [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)]
)
def test_openai_routes_refuse_extensions_they_would_ignore(model, base, field, value, no_op):
    assert _refused_at(model, {**base, field: value}) == (field,)
    model.model_validate({**base, field: no_op})


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"lora_path": "adapter"}, ("lora_path",)),
        ({"image_data": "cat.png"}, ("image_data",)),
        ({"audio_data": "a.wav"}, ("audio_data",)),
        ({"video_data": "v.mp4"}, ("video_data",)),
        ({"input_embeds": [[0.1, 0.2]]}, ("input_embeds",)),
        ({"custom_logit_processor": "x"}, ("custom_logit_processor",)),
        ({"sampling_params": {"stop_regex": "[0-9]"}}, ("sampling_params", "stop_regex")),
    ],
)
def test_generate_refuses_sglang_fields_it_would_ignore(body, loc):
    assert _refused_at(GenerateRequestBody, {**GENERATE, **body}) == loc
    GenerateRequestBody.model_validate(
        {**GENERATE, "lora_path": None, "image_data": None, "sampling_params": {"logit_bias": {}}}
    )


@pytest.mark.parametrize(
    ("field", "value", "no_op"),
    [
        ("chat_template", "{{ messages }}", None),  # vLLM
        ("documents", [{"text": "d"}], []),  # vLLM
        ("mm_processor_kwargs", {"num_crops": 4}, {}),  # vLLM
    ],
)
def test_chat_refuses_template_extensions_it_would_ignore(field, value, no_op):
    assert _refused_at(ChatCompletionRequest, {**CHAT, field: value}) == (field,)
    ChatCompletionRequest.model_validate({**CHAT, field: no_op})


def test_the_defaults_sglangs_router_sends_pass():
    """SGLang's router writes its request's every field, its defaults included: a refused
    separate_reasoning (true by default, nothing without a reasoning parser) failed every chat
    request it forwarded."""
    defaults = {
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "priority": None,
        "lora_path": None,
    }
    ChatCompletionRequest.model_validate({**CHAT, **defaults})
