"""Structured output through `kubesgl serve` and the OpenAI SDK: every json_schema answer
validates, streaming or not, with overlap on and off and page sizes 1 and 16; json_object
answers are objects; /generate takes SGLang's regex, json_schema and ebnf; a grammar that
cannot compile is a 400 naming it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from json_schemas import SCHEMAS
from serve_harness import start_server

HEADERS = {"authorization": "Bearer sk-test"}


def _parse(text: str):
    return json.loads(text)  # strict: no raw control characters in a string


@pytest.fixture(
    scope="module",
    params=[("overlap", "1"), ("no-overlap", "16")],
    ids=lambda p: f"{p[0]}-page{p[1]}",
)
def server(request, tiny_model, tmp_path_factory):
    overlap, page = request.param
    args = ["--api-key", "sk-test", "--served-model-name", "m", "--page-size", page] + (
        ["--disable-overlap-schedule"] if overlap == "no-overlap" else []
    )
    server = start_server(tiny_model("llama"), *args, tmp_path=tmp_path_factory.mktemp("serve"))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="sk-test", max_retries=0)


def _format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


@pytest.mark.parametrize("name", SCHEMAS)
def test_chat_json_schema_answers_validate(client, name):
    answer = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format=_format(name),
        max_tokens=150,
        n=3,
        temperature=1.0,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(_parse(choice.message.content), SCHEMAS[name])


@pytest.mark.parametrize("name", SCHEMAS)
def test_streamed_json_schema_answers_validate(client, name):
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "stream it"}],
        response_format=_format(name),
        max_tokens=150,
        stream=True,
        temperature=0.7,
    )
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(_parse("".join(parts)), SCHEMAS[name])


def test_completions_json_schema_and_json_object(client):
    # response_format is an extension on completions (as in vLLM and SGLang): the SDK sends it in extra_body
    answer = client.completions.create(
        model="m",
        prompt=["a", "b"],
        max_tokens=100,
        extra_body={"response_format": _format("bounded")},
    )
    for choice in answer.choices:
        jsonschema.validate(_parse(choice.text), SCHEMAS["bounded"])
    answer = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=300,
        response_format={"type": "json_object"},
        temperature=0,
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(_parse(answer.choices[0].message.content), dict)
    assert answer.choices[0].message.content.startswith("{")


def test_native_generate_regex_json_schema_ebnf(server):
    def generate(**constraint):
        got = httpx.post(
            server.base_url + "/generate",
            headers=HEADERS,
            timeout=60,
            json={
                "text": "go",
                "sampling_params": {"max_new_tokens": 60, "temperature": 0.8, **constraint},
            },
        )
        assert got.status_code == 200, got.text
        assert got.json()["meta_info"]["finish_reason"]["type"] == "stop"
        return got.json()["text"]

    assert re.fullmatch(r"(ab|cd){2,4}!", generate(regex=r"(ab|cd){2,4}!"))
    jsonschema.validate(_parse(generate(json_schema=json.dumps(SCHEMAS["enum"]))), SCHEMAS["enum"])
    assert re.fullmatch(
        r"\([0-9](,[0-9])*\)", generate(ebnf='root ::= "(" d ("," d)* ")"\nd ::= [0-9]')
    )


def test_openai_routes_take_sglangs_regex_json_schema_and_ebnf(client):
    """As SGLang's OpenAI routes do (the SDK's extra_body): an SGLang user moving over keeps
    the constraint (they were ignored before)."""
    answer = client.completions.create(
        model="m", prompt=["a", "b"], max_tokens=60, extra_body={"regex": r"(ab|cd){2,4}!"}
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(r"(ab|cd){2,4}!", choice.text)
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=60,
        extra_body={"ebnf": 'root ::= "(" d ("," d)* ")"\nd ::= [0-9]'},
    )
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", chat.choices[0].message.content)
    schema = client.completions.create(
        model="m",
        prompt="x",
        max_tokens=60,
        extra_body={"json_schema": json.dumps(SCHEMAS["enum"])},
    )
    jsonschema.validate(_parse(schema.choices[0].text), SCHEMAS["enum"])


@pytest.mark.parametrize(
    "route, body, param, words",
    [
        (
            "/v1/completions",
            {"prompt": "x", "regex": "a", "response_format": {"type": "json_object"}},
            "regex",
            "together with response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a"},
            "guided_regex",
            "use regex",
        ),
        ("/v1/completions", {"prompt": "x", "regex": "(ab"}, "regex", "parenthesis"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "b", "schema": {"type": "nonsense"}},
                },
            },
            "response_format",
            "nonsense",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "b", "schema": {"type": "nonsense"}},
                },
            },
            "response_format",
            "nonsense",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
            "response_format",
            "json_schema",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "yaml"}},
            "response_format",
            "json_object",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"json_schema": '{"type": "nonsense"}'}},
            "sampling_params.json_schema",
            "nonsense",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "(ab"}},
            "sampling_params.regex",
            "parenthesis",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"ebnf": "root ::= foo"}},
            "sampling_params.ebnf",
            "foo",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "sampling_params",
            "at most one",
        ),
    ],
)
def test_bad_grammars_are_400s_naming_the_problem(server, route, body, param, words):
    got = httpx.post(server.base_url + route, json=body, headers=HEADERS, timeout=30)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert param in (error["param"] or ""), error
    assert words in error["message"], error
    # the field once: the server words its name as the client's, prose included (it was
    # "sampling_params.json_schema: the sampling_params.json_schema cannot be compiled")
    assert error["message"].count(param) <= 1, error


def test_grammar_metrics_are_exported(server, client):
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        response_format=_format("enum"),
        max_tokens=30,
    )
    assert server.metric("kubesgl_grammar_compile_seconds_count") >= 1
    text = httpx.get(server.base_url + "/metrics").text
    hits = [
        line
        for line in text.splitlines()
        if line.startswith("kubesgl_grammar_cache_total") and 'result="hit"' in line
    ]
    assert (
        hits and float(hits[0].rsplit(" ", 1)[1]) >= 1
    )  # "enum" was compiled by an earlier test of this server


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "required": ["city", "unit"],
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _assert_calls_validate(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or PARAMETERS)
        jsonschema.validate(_parse(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("temperature, parallel", [(0, True), (1.0, False)])
def test_tool_choice_required_always_calls_a_tool_with_valid_arguments(
    client, temperature, parallel
):
    answer = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        max_tokens=200,
        temperature=temperature,
        parallel_tool_calls=parallel,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        _assert_calls_validate(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments_streaming_or_not(client):
    choice = {"type": "function", "function": {"name": "add"}}
    answer = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=1.0
    )
    assert answer.choices[0].finish_reason == "stop"  # as OpenAI's for a named function
    _assert_calls_validate(answer.choices[0].message.tool_calls, ["add"])
    calls, finish = {}, None
    for chunk in client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=100,
        temperature=1.0,
        stream=True,
    ):
        for delta_choice in chunk.choices:
            assert not delta_choice.delta.content  # a call is no content
            for call in delta_choice.delta.tool_calls or []:
                calls.setdefault(call.index, []).append(call)
            finish = delta_choice.finish_reason or finish
    assert finish == "stop" and list(calls) == [0]
    call = calls[0][0]
    assert call.function.name == "add"
    jsonschema.validate(_parse("".join(c.function.arguments for c in calls[0])), PARAMETERS["add"])


def test_auto_and_none_reach_the_chat_template(client):
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    none = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert (
        auto.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    )  # the tools' description
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert (
        auto.choices[0].message.tool_calls is None
    )  # a random model writes no <tool_call> block here
    assert auto.choices[0].finish_reason == "length"


def _answered(client, stream: bool, **request) -> tuple[str | None, list, str | None]:
    """(content, calls as (name, arguments), finish_reason) of one chat answer, streamed or not."""
    if not stream:
        (choice,) = client.chat.completions.create(model="m", messages=ASK, **request).choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="m", messages=ASK, stream=True, **request):
        for delta_choice in chunk.choices:
            content += delta_choice.delta.content or ""
            calls += [
                (c.function.name, c.function.arguments) for c in delta_choice.delta.tool_calls or []
            ]
            finish = delta_choice.finish_reason or finish
    return content or None, calls, finish


CALL = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_of_declared_functions_and_one_without_parallel_calls(client, stream):
    """The answers forced with SGLang's regex: a call of a function the tools do not declare
    leaves the whole answer content; parallel_tool_calls false gives the first call only."""
    undeclared = CALL.format("add") + "\n" + CALL.format("rm")
    got = _answered(
        client, stream, tools=TOOLS, max_tokens=400, extra_body={"regex": re.escape(undeclared)}
    )
    assert got == (undeclared, [], "stop")
    two = CALL.format("add") + "\n" + CALL.format("get_weather")
    got = _answered(
        client,
        stream,
        tools=TOOLS,
        parallel_tool_calls=False,
        max_tokens=400,
        extra_body={"regex": re.escape(two)},
    )
    assert got == (None, [("add", "{}")], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_cut_by_max_tokens_are_still_calls(client, stream):
    """As vLLM: the named function with its arguments as far as they came."""
    named = {"type": "function", "function": {"name": "add"}}
    content, calls, finish = _answered(client, stream, tools=TOOLS, tool_choice=named, max_tokens=3)
    assert (content, [name for name, _ in calls], finish) == (None, ["add"], "length")


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_answer_cut_before_its_first_call_is_content(client, stream):
    """Cut before a name was whole, it holds no call: its text, the start of the list of
    calls, is the content (it was lost: content null and no tool_calls)."""
    content, calls, finish = _answered(
        client, stream, tools=TOOLS, tool_choice="required", max_tokens=4
    )
    assert (calls, finish) == ([], "length")
    assert content is not None and content.startswith("["), content


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "both",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "bad", "parameters": {"type": "nonsense"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "nonsense",
        ),
    ],
)
def test_bad_tool_requests_are_400s(server, body, param, words):
    got = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=HEADERS,
        timeout=30,
        json={"messages": ASK, "max_tokens": 4, **body},
    )
    assert got.status_code == 400, got.text
    assert (
        param in (got.json()["error"]["param"] or "") and words in got.json()["error"]["message"]
    ), got.text


def test_tensor_parallel_ranks_queue_grammar_requests_alike(server_factory, tiny_model):
    """Every rank waits for its own compilation at arrival, so all ranks step the same batches:
    concurrent grammar requests (each schema new) answer what one rank alone answers."""
    from concurrent.futures import ThreadPoolExecutor

    from kubesgl.engine import LLM, SamplingParams
    from kubesgl.engine.sampling_params import GrammarSpec

    path = tiny_model("llama")
    server = server_factory(path, "--tp-size", "2")
    schemas = [
        {**SCHEMAS["bounded"], "title": f"s{i}"} for i in range(6)
    ]  # distinct texts: six compilations

    def ask(schema):
        got = httpx.post(
            server.base_url + "/generate",
            timeout=120,
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {
                    "max_new_tokens": 60,
                    "temperature": 0,
                    "json_schema": json.dumps(schema),
                },
            },
        )
        assert got.status_code == 200, got.text
        return got.json()["output_ids"]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, schemas))
    with LLM(path, device="cpu", dtype="float32", max_total_tokens=4096) as llm:
        want = [
            o.token_ids
            for o in llm.generate(
                [[5, 6, 7]] * 6,
                [
                    SamplingParams(
                        max_tokens=60,
                        temperature=0,
                        grammar=GrammarSpec("json_schema", json.dumps(s)),
                    )
                    for s in schemas
                ],
            )
        ]
    assert got == want
    bad = httpx.post(
        server.base_url + "/generate",
        timeout=60,
        json={"text": "x", "sampling_params": {"regex": "(ab"}},
    )
    assert bad.status_code == 400
    assert server.stop() == 0


def test_unconstrained_answers_beside_constrained_ones_equal_transformers(client, tiny_model):
    """Requests sent at once, every other one with a schema: the plain ones get transformers'
    greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [[5, 6, 7, 8], list(range(40, 90)), [300, 12, 99], list(range(100, 130))]

    def ask(i):
        if i % 2:
            return client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"q{i}"}],
                response_format=_format("nested"),
                max_tokens=120,
            )
        return client.completions.create(
            model="m", prompt=prompts[i // 2], max_tokens=12, temperature=0
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for i in range(0, 8, 2):
        prompt = prompts[i // 2]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[
                0, len(prompt) :
            ]
        assert answers[i].choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    for i in range(1, 8, 2):
        jsonschema.validate(_parse(answers[i].choices[0].message.content), SCHEMAS["nested"])
