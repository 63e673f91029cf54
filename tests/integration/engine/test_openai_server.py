"""`kubesgl serve` driven by the official openai SDK and httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubesgl import __version__
from kubesgl.engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Count from one to ten:",
    "Kubernetes schedules pods",
    "🙂 naïve café",
]


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", max_total_tokens=8192)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=llama_server.openai_url, api_key="sk-test", max_retries=0)


@pytest.fixture
async def async_client(llama_server):
    async with openai.AsyncOpenAI(
        base_url=llama_server.openai_url, api_key="sk-test", max_retries=0
    ) as client:
        yield client


def greedy_offline(offline, prompt, n=24, **kw):
    ids = prompt if isinstance(prompt, list) else offline.tokenizer.encode(prompt)
    return offline.generate([ids], SamplingParams(max_tokens=n, temperature=0, **kw))[0]


def test_completions_equal_offline_llm(client, offline):
    for prompt in PROMPTS:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        ref = greedy_offline(offline, prompt)
        assert got.choices[0].text == ref.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert (
            got.usage.completion_tokens == 24
            and got.usage.total_tokens == got.usage.prompt_tokens + 24
        )


def test_streaming_completion_equals_non_streaming(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[3],
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices


def test_chat_uses_the_chat_template(client, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "weather?"},
    ]
    ids = offline.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    ref = greedy_offline(offline, list(ids), 16)
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    assert got.choices[0].message.content == ref.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text


def test_a_streamed_chat_with_two_choices_reads_as_openais(llama_server):
    """On the wire: a role chunk per choice, one choice per chunk, `usage: null` on every
    chunk before the usage chunk (clients that test `usage !== null` read it so)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = httpx.post(
        llama_server.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer sk-test"},
        timeout=60,
    )
    lines = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    *chunks, last = [json.loads(line) for line in lines[:-1]]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    roles = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("role")) for c in chunks]
    assert [index for index, role in roles if role == "assistant"] == [0, 1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6


def test_chat_template_options_reach_the_template(client, offline, llama_server):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for body, template_arguments in (
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"add_generation_prompt": True, "enable_thinking": False},
        ),
    ):
        ids = offline.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, **template_arguments
        )
        got = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, n=2, extra_body=body
        )
        assert got.usage.prompt_tokens == len(ids), body
    refused = httpx.post(
        f"{llama_server.openai_url}/chat/completions",
        headers={"Authorization": "Bearer sk-test"},
        json={"model": "tiny", "messages": messages, "chat_template_kwargs": {"tools": []}},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"


async def test_async_client_concurrent(async_client, offline):
    results = await asyncio.gather(
        *(
            async_client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            for p in PROMPTS
        )
    )
    assert [r.choices[0].text for r in results] == [
        greedy_offline(offline, p, 12).text for p in PROMPTS
    ]


def test_stop_strings_across_token_boundaries(client, offline):
    ref = greedy_offline(offline, PROMPTS[0], 30).text
    stop = ref[10:14]  # four characters in the middle of the text, wherever tokens split them
    got = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == ref[: ref.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = ""
    for chunk in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop], stream=True
    ):
        streamed += chunk.choices[0].text
        assert stop not in streamed  # not even for a moment
    assert streamed == ref[: ref.index(stop)]
    # vLLM's include_stop_str_in_output and SGLang's no_stop_trim keep it, streamed or not
    kept = ref[: ref.index(stop) + len(stop)]
    for extra in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}):
        for stream in (False, True):
            got = client.completions.create(
                model="tiny",
                prompt=PROMPTS[0],
                max_tokens=30,
                temperature=0,
                stop=[stop],
                stream=stream,
                extra_body=extra,
            )
            text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
            assert text == kept, (extra, stream)


def test_a_stop_token_ends_the_answer_without_its_text(client, offline):
    """As vLLM and SGLang: the stop token is counted and not shown, unless asked for."""
    ids = greedy_offline(offline, PROMPTS[0], 30).token_ids
    # a token with text, first met past the start: the answer stops there
    at = next(
        i
        for i in range(2, len(ids))
        if ids[i] not in ids[:i] and offline.tokenizer.decode(ids[i : i + 1]).strip()
    )
    stop_token, answer = ids[at], offline.tokenizer.decode(ids[:at])
    for extra, text in (
        ({}, answer),
        ({"include_stop_str_in_output": True}, offline.tokenizer.decode(ids[: at + 1])),
    ):
        body = {"stop_token_ids": [stop_token], **extra}
        for stream in (False, True):
            got = client.completions.create(
                model="tiny",
                prompt=PROMPTS[0],
                max_tokens=30,
                temperature=0,
                stream=stream,
                extra_body=body,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            )
            chunks = list(got) if stream else [got]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text, body
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            assert chunks[-1].usage.completion_tokens == at + 1


def test_n_copies_share_the_cached_prompt(client):
    prompt = (
        "Prefill computes the cache of a whole prompt at once; decode adds one token at a time." * 2
    )
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    assert len({c.text for c in got.choices}) > 1  # seeded copies differ
    assert got.usage.completion_tokens == 32
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # counted once, for the first copy
    again = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=4, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded: reproducible


def test_logprobs(client):
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(
            entry.top_logprobs[0].logprob
        )  # greedy picks the top token
    # raw token bytes, not the UTF-8 of each token's text alone: together they spell the reply
    text = b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace")
    assert text == got.choices[0].message.content
    completion = client.completions.create(
        model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=2
    )
    assert len(completion.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) == 2 for t in completion.choices[0].logprobs.top_logprobs)


def test_every_route_says_the_stop_reason_as_vllm_and_sglang(llama_server, offline):
    """stop_reason on each choice, streamed (on the last chunk of the choice, null before) or
    not: the stop string or stop token that ended it, null on length; /generate names it as
    SGLang's finish_reason.matched."""
    ref = greedy_offline(offline, PROMPTS[0], 30)
    stop, stop_token = ref.text[10:14], ref.token_ids[3]
    headers = {"authorization": "Bearer sk-test"}
    cases = [
        ({"stop": [stop]}, stop),
        ({"stop_token_ids": [stop_token]}, stop_token),
        ({"max_tokens": 2, "ignore_eos": True}, None),
    ]
    chat = [{"role": "user", "content": PROMPTS[0]}]
    for extra, expected in cases:
        for path, prompt in (
            ("/v1/completions", {"prompt": PROMPTS[0]}),
            ("/v1/chat/completions", {"messages": chat}),
        ):
            body = {"model": "tiny", "max_tokens": 30, "temperature": 0, **prompt, **extra}
            whole = httpx.post(llama_server.base_url + path, json=body, headers=headers).json()
            (choice,) = whole["choices"]
            if path == "/v1/completions":  # a chat's template makes another answer, not asserted on
                assert choice["stop_reason"] == expected, (path, extra)
            chunks = []
            with httpx.stream(
                "POST", llama_server.base_url + path, json={**body, "stream": True}, headers=headers
            ) as streamed:
                for line in streamed.iter_lines():
                    if line.startswith("data: {"):
                        chunks += json.loads(line.removeprefix("data: "))["choices"]
            assert [c["stop_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
            assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == (
                choice["finish_reason"],
                choice["stop_reason"],
            ), (path, extra)
    sampling = {"max_new_tokens": 30, "temperature": 0, "stop": [stop]}
    native = httpx.post(
        llama_server.base_url + "/generate",
        json={"text": PROMPTS[0], "sampling_params": sampling},
        headers=headers,
    ).json()
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_native_generate(llama_server, offline):
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    got = httpx.post(
        llama_server.base_url + "/generate", json=body, headers={"authorization": "Bearer sk-test"}
    )
    assert got.status_code == 200
    ref = greedy_offline(offline, PROMPTS[1], 10)
    assert got.json()["text"] == ref.text and got.json()["output_ids"] == ref.token_ids


def test_models_and_api_key(llama_server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and 0 < card.created <= time.time()  # when the server started
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    bad = openai.OpenAI(base_url=llama_server.openai_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert (
        httpx.post(llama_server.base_url + "/v1/completions", json={"prompt": "x"}).status_code
        == 401
    )
    assert httpx.get(llama_server.base_url + "/health").status_code == 200  # health needs no key
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x" * 5000, "max_tokens": 4}, "prompt"),
        ({"prompt": "x", "max_tokens": 3000}, "max_tokens"),
        ({"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"prompt": []}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400(llama_server, body, param):
    got = httpx.post(
        llama_server.base_url + "/v1/completions",
        json=body,
        headers={"authorization": "Bearer sk-test"},
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (
        error["type"] == "invalid_request_error"
        and param in (error["param"] or "")
        and error["message"]
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "seed": -(2**63) - 1},
            "seed",
        ),
        ("/generate", {"text": "x", "sampling_params": {"seed": 2**63}}, "sampling_params.seed"),
    ],
)
def test_a_seed_outside_64_bits_is_a_400_on_every_route(llama_server, path, body, param):
    """As vLLM's schema bounds it; it was taken, sampled as its remainder modulo 2**63."""
    got = httpx.post(
        llama_server.base_url + path, json=body, headers={"authorization": "Bearer sk-test"}
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith(f"{param}: Input should be"), error["message"]


def test_a_negative_seed_samples_reproducibly_as_any_other(client):
    ask = dict(model="tiny", prompt="Count from one to ten:", max_tokens=8, temperature=1.0)
    got = [client.completions.create(**ask, seed=seed).choices[0].text for seed in (-7, -7, 7)]
    assert got[0] == got[1] != got[2]


HUGE_TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d" * 1_000_000, "parameters": {"type": "object"}},
}


@pytest.mark.parametrize(
    "path, body, param, words",
    [  # refused by the API server, by their size, before anything is tokenized or sent on
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [HUGE_TOOL]},
            "messages",
            "characters long",
        ),
        (
            "/v1/completions",
            {"prompt": [[5, 6], [5] * 100_000], "max_tokens": 1},
            "prompt.1",
            "tokens long",
        ),
        ("/generate", {"input_ids": [5] * 100_000}, "input_ids", "tokens long"),
    ],
)
def test_a_prompt_too_long_for_the_context_is_refused_before_the_tokenizer(
    llama_server, path, body, param, words
):
    got = httpx.post(
        llama_server.base_url + path, json=body, headers={"authorization": "Bearer sk-test"}
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and words in error["message"], error


LONG_TEXT = "hi " * 3000  # within the character limit, over the context once tokenized


@pytest.mark.parametrize(
    "path, body, param",
    [  # refused by the scheduler, once tokenized: the error names the field the prompt came from
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG_TEXT}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": ["ok", LONG_TEXT], "max_tokens": 1}, "prompt.1"),
        ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1, "n": 2}, "prompt"),
        ("/generate", {"text": LONG_TEXT}, "text"),
    ],
)
def test_a_tokenized_prompt_too_long_names_its_field(llama_server, path, body, param):
    got = httpx.post(
        llama_server.base_url + path, json=body, headers={"authorization": "Bearer sk-test"}
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and "tokens long" in error["message"], error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),  # tokenized
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2048}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 40000}]}, "messages"),  # characters
    ],
)
def test_a_request_over_the_context_has_openais_code(client, body, param):
    """OpenAI answers `code: "context_length_exceeded"`, which clients that trim a conversation
    grown too long look for; each of the engine's context checks answers it."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", **body)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == param


def test_a_token_id_prompt_over_the_context_has_openais_code(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=[5] * 4096, max_tokens=1)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"


def test_logit_bias_moves_the_tokens_it_names(client):
    """OpenAI's logit_bias, keyed by token ids as text: +100 all but forces a token."""
    forced = client.completions.create(
        model="tiny", prompt="hi", max_tokens=4, logprobs=0, logit_bias={"7": 100}
    )
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        logit_bias={"7": 100},
    )
    assert [t.token for t in chat.choices[0].logprobs.content] == forced.choices[0].logprobs.tokens


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"hello": 1}, "keys must be token ids, got 'hello'"),
        ({"7": 101}, "less than or equal to 100"),
        ({"100000": 1}, "outside the vocabulary"),
        # int() refuses more than 4300 digits: such a key was a 500, a traceback in the log
        ({"9" * 4301: 1}, "keys must be token ids, got '99999999999999999999'..."),
        ({"7": 1, "007": -1}, "token 7 is named twice"),
    ],
    ids=["not-an-id", "too-large", "outside-the-vocabulary", "4301-digits", "token-twice"],
)
def test_a_bad_logit_bias_is_a_400(client, bias, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, logit_bias=bias)
    assert refused.value.param.startswith("logit_bias") and words in refused.value.message


def test_bad_chat_requests_get_400(llama_server):
    headers = {"authorization": "Bearer sk-test", "content-type": "application/json"}
    url = llama_server.base_url + "/v1/chat/completions"
    assert httpx.post(url, content=b"{not json", headers=headers).status_code == 400
    assert httpx.post(url, json={"messages": []}, headers=headers).status_code == 400
    assert (
        httpx.post(
            url, json={"messages": [{"role": "wizard", "content": "x"}]}, headers=headers
        ).status_code
        == 400
    )
    # unknown fields are accepted and ignored, as OpenAI does
    ok = httpx.post(
        url,
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "frobnicate": 1},
        headers=headers,
    )
    assert ok.status_code == 200


CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, "audio"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {}}, "stream_options"),
        ("/v1/chat/completions", {**CHAT, "guided_choice": ["a", "b"]}, "guided_choice"),
        ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/chat/completions", {**CHAT, "verbosity": "low"}, "verbosity"),
        ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
        (
            "/v1/chat/completions",
            {**CHAT, "moderation": {"model": "omni-moderation-latest"}},
            "moderation",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "prediction": {"type": "content", "content": "x"}},
            "prediction",
        ),
        (
            "/v1/completions",
            {
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            "stream_options.continuous_usage_stats",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [_tool("f"), _tool("g"), _tool("f")]},
            "tools",
        ),
    ],
)
def test_openai_fields_not_implemented_are_refused_not_ignored(llama_server, path, body, param):
    """Each would change the answer; served without it, the client would get another answer
    than it asked for and no sign of it. Their no-op values (best_of 1, echo false) are accepted, as clients send them by default."""
    url, headers = llama_server.base_url + path, {"authorization": "Bearer sk-test"}
    got = httpx.post(url, json={"model": "tiny", **body}, headers=headers)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param
    assert ": is " not in got.json()["error"]["message"]  # "best_of is not supported ..."
    assert any(
        words in got.json()["error"]["message"]
        for words in ("not supported", "needs", "name each function once")
    )
    no_ops = {
        "best_of": 1,
        "suffix": "",
        "echo": False,
        "function_call": "none",
        "modalities": ["text"],
    }
    if param in no_ops:
        fine = httpx.post(
            url, json={"model": "tiny", **body, param: no_ops[param]}, headers=headers
        )
        assert fine.status_code == 200, fine.text


def test_errors_name_the_fields_the_sdk_sent(client):
    """max_completion_tokens is max_tokens to the engine, and tool_choice a union to pydantic:
    the 400 names what the client wrote."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_completion_tokens=100000
        )
    error = raised.value.body
    assert error["param"] == "max_completion_tokens", error
    assert "max_completion_tokens" in error["message"] and "max_tokens" not in error["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
        )
    assert raised.value.body["param"] == "tool_choice.type", raised.value.body


def test_a_json_schema_response_format_without_a_schema_is_any_json_object(client):
    # the same constraint as json_object: greedy, the same answer (the random model's object
    # may still be open at max_tokens, so its text is not parsed)
    def answer(response_format: dict) -> str:
        got = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            response_format=response_format,
            max_tokens=60,
            temperature=0,
        )
        return got.choices[0].message.content

    without_schema = answer({"type": "json_schema", "json_schema": {"name": "any"}})
    assert without_schema.startswith("{")
    assert without_schema == answer({"type": "json_object"})


def test_the_responses_api_is_refused_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="tiny", input="x")
    assert "/v1/chat/completions" in raised.value.body["message"], raised.value.body


def test_a_body_sent_without_the_json_content_type_is_told_so(llama_server):
    """curl -d without -H 'content-type: application/json' sends a form content type."""
    got = httpx.post(
        llama_server.base_url + "/v1/completions",
        content=b'{"model": "tiny", "prompt": "x", "max_tokens": 2}',
        headers={
            "authorization": "Bearer sk-test",
            "content-type": "application/x-www-form-urlencoded",
        },
    )
    assert got.status_code == 400
    assert "Content-Type: application/json" in got.json()["error"]["message"]


async def test_bad_request_does_not_harm_a_concurrent_good_one(async_client, offline):
    async def bad():
        with pytest.raises(openai.BadRequestError):
            await async_client.completions.create(model="tiny", prompt="x" * 5000, max_tokens=4)

    good = async_client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0
    )
    result, *_ = await asyncio.gather(good, bad(), bad())
    assert result.choices[0].text == greedy_offline(offline, PROMPTS[0], 20).text


async def test_200_concurrent_streams_complete_and_free_the_pool(async_client, llama_server):
    async def one(i: int) -> int:
        count = 0
        stream = await async_client.completions.create(
            model="tiny",
            prompt=f"request {i}",
            max_tokens=5 + i % 20,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return count

    counts = await asyncio.gather(*(one(i) for i in range(200)))
    assert counts == [5 + i % 20 for i in range(200)]
    llama_server.wait_idle()


async def test_abort_mid_stream_frees_everything(llama_server):
    async with httpx.AsyncClient(
        base_url=llama_server.base_url, headers={"authorization": "Bearer sk-test"}
    ) as http:
        for _ in range(3):
            async with http.stream(
                "POST",
                "/v1/completions",
                json={
                    "prompt": "a long one",
                    "max_tokens": 1500,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as response:
                lines = response.aiter_lines()
                for _ in range(6):
                    await anext(lines)
            # leaving the block closes the connection mid-stream
        body = {"prompt": "a long one", "max_tokens": 1500, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                "/v1/completions", json=body, timeout=0.5
            )  # non-streaming, client gives up
    llama_server.wait_idle()


def test_metrics_exact_for_a_known_workload(server_factory, tiny_model):
    server = server_factory(tiny_model("llama"), "--page-size", "1")
    assert server.metric("kubesgl_prefix_cache_hit_ratio") == 0
    prompt = list(range(10, 60))  # 50 tokens
    for _ in range(2):
        got = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True},
        )
        assert got.status_code == 200
    # the second request found 49 of its 50 tokens cached (the last is always computed)
    assert server.metric("kubesgl_prefix_cache_hit_ratio") == pytest.approx(49 / 100)
    assert server.metric("kubesgl_prompt_tokens_total") == 100
    assert server.metric("kubesgl_generation_tokens_total") == 10
    families = list(text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text))
    finished = {
        s.labels["finish_reason"]: s.value
        for family in families
        for s in family.samples
        if s.name == "kubesgl_requests_total"
    }
    assert finished == {
        "stop": 0,
        "length": 2,
        "abort": 0,
    }  # every reason from the start (issue 15)
    # every sample names the role and, as vLLM's do, the served model
    (model,) = [card["id"] for card in httpx.get(server.base_url + "/v1/models").json()["data"]]
    labels = {
        (s.labels.get("role"), s.labels.get("model_name"))
        for family in families
        for s in family.samples
    }
    assert labels == {("mixed", model)}
    assert any(
        s.name == "kubesgl_time_to_first_token_seconds_count"
        for family in families
        for s in family.samples
    )
    server.wait_idle()
    assert server.stop() == 0


async def test_a_reused_request_id_is_refused_and_the_first_request_is_unharmed(llama_server):
    headers = {"authorization": "Bearer sk-test"}
    body = {
        "input_ids": [5, 6, 7],
        "rid": "mine",
        "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
    }
    async with httpx.AsyncClient(
        base_url=llama_server.base_url, headers=headers, timeout=60
    ) as http:
        first = asyncio.create_task(http.post("/generate", json=body))
        while llama_server.metric("kubesgl_num_running_requests") < 1:
            await asyncio.sleep(0.01)
        second = await http.post("/generate", json=body)
        assert second.status_code == 400 and "already in use" in second.json()["error"]["message"]
        result = (await first).json()
    assert (
        len(result["output_ids"]) == 600
        and result["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_disconnects_are_counted_as_aborts(llama_server):
    def aborts() -> float:
        text = httpx.get(llama_server.base_url + "/metrics").text
        lines = [
            line
            for line in text.splitlines()
            if line.startswith("kubesgl_requests_total") and "abort" in line
        ]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = aborts()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            llama_server.base_url + "/v1/completions",
            headers={"authorization": "Bearer sk-test"},
            json={"prompt": "x", "max_tokens": 1500, "ignore_eos": True},
            timeout=0.3,
        )
    llama_server.wait_idle()
    assert aborts() == before + 1


def test_health_generate_generates_without_counting_a_request(llama_server):
    """A load balancer's or router's probe every few seconds must not move the request
    metrics that dashboards and autoscaling read."""
    counted = [
        'kubesgl_requests_total{finish_reason="length"}',
        'kubesgl_requests_total{finish_reason="stop"}',
        'kubesgl_requests_total{finish_reason="abort"}',
        "kubesgl_e2e_request_latency_seconds_count",
        "kubesgl_time_to_first_token_seconds_count",
        "kubesgl_request_queue_time_seconds_count",
        "kubesgl_prompt_tokens_total",
        "kubesgl_generation_tokens_total",
    ]
    before = [llama_server.metric(name) for name in counted]
    for _ in range(3):
        probe = httpx.get(
            llama_server.base_url + "/health_generate",
            headers={"authorization": "Bearer sk-test"},
        )
        assert (probe.status_code, probe.text) == (200, "ok")
    llama_server.wait_idle()
    assert [llama_server.metric(name) for name in counted] == before


def test_flush_cache_empties_the_prefix_cache_once_the_scheduler_has(llama_server):
    headers = {"authorization": "Bearer sk-test"}
    body = {"prompt": "the same prompt, a few tokens long, " * 8, "max_tokens": 1}

    def cached() -> int:
        answer = httpx.post(llama_server.base_url + "/v1/completions", json=body, headers=headers)
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    flushed = httpx.post(llama_server.base_url + "/flush_cache", headers=headers)
    assert (flushed.status_code, flushed.text) == (200, "Cache flushed.")
    assert cached() == 0


def test_an_idle_connection_outlives_the_routers_keep_alive(llama_server):
    """The engine keeps an idle connection open longer than the router keeps one in its pool
    (uvicorn's default closed it after 5 s, racing the router's next request on it: a 502,
    and a healthy worker taken out of the pool)."""
    import http.client
    from urllib.parse import urlsplit

    from kubesgl import contract

    assert contract.ROUTER_UPSTREAM_KEEP_ALIVE_S < contract.SERVER_KEEP_ALIVE_S
    address = urlsplit(llama_server.base_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        for pause in (0, 6):  # past uvicorn's default of 5 s
            time.sleep(pause)
            connection.request("GET", "/health")  # on the same connection: none is reopened
            answer = connection.getresponse()
            answer.read()  # the whole answer, whatever segments it came in
            assert answer.status == 200 and not answer.will_close
    finally:
        connection.close()


def test_tokenize_counts_what_a_request_with_the_prompt_counts(llama_server, client):
    """vLLM's /tokenize and /detokenize: the count is the usage's prompt_tokens of a chat or
    completion request with that prompt, and the tokens read back as the text."""
    key = {"authorization": "Bearer sk-test"}
    messages = [{"role": "user", "content": "🙂 naïve café"}]
    tokenize = lambda body: httpx.post(  # noqa: E731
        llama_server.base_url + "/tokenize", json={"model": "tiny", **body}, headers=key
    ).json()
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert tokenize({"messages": messages})["count"] == chat.usage.prompt_tokens
    # and with what else a chat prompt renders from: tools, the template's controls and variables
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    options = {"tools": [tool], "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        tools=[tool],
        extra_body={k: options[k] for k in ("add_generation_prompt", "chat_template_kwargs")},
    )
    assert tokenize({"messages": messages, **options})["count"] == chat.usage.prompt_tokens
    completion = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=1)
    tokens = tokenize({"prompt": PROMPTS[3]})
    assert tokens["count"] == completion.usage.prompt_tokens and tokens["max_model_len"] > 0
    text = httpx.post(
        llama_server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=key
    )
    assert text.json() == {"prompt": PROMPTS[3]}
    assert httpx.get(llama_server.base_url + "/version").json() == {"version": __version__}
