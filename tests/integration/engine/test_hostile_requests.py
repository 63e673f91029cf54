"""Hostile values in every string field of every endpoint: each is a 400 that names the
field, and the engine goes on serving (a lone surrogate, what a JavaScript client sends when
it cuts an emoji in half, used to crash the whole engine)."""

from __future__ import annotations

import json

import httpx
import pytest

SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800", as a JavaScript client does


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


CASES = [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a" + SURROGATE]}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "stop": SURROGATE}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", SURROGATE]}, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "model": SURROGATE}, "model"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SURROGATE}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": SURROGATE},
        "stop",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": [SURROGATE]},
        "stop.0",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool(SURROGATE, {})]},
        "tools.0.function.name",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("f", {SURROGATE: 1})]},
        "tools.0.function.parameters",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["ok", SURROGATE]}},
            },
        },
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": SURROGATE}},
        "chat_template_kwargs",
    ),
    ("/generate", {"text": SURROGATE}, "text"),
    (  # the schema as text, its surrogate an escape within it
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": json.dumps({"pattern": SURROGATE})}},
        "sampling_params.json_schema",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"stop": SURROGATE}}, "sampling_params.stop"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"stop": ["x", SURROGATE]}},
        "sampling_params.stop.1",
    ),
    ("/generate", {"text": "hi", "rid": SURROGATE}, "rid"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_text_that_is_not_utf8_is_a_400_naming_the_field_and_the_engine_goes_on(
    llama_server, stream
):
    headers = {"authorization": "Bearer sk-test", "content-type": "application/json"}
    with httpx.Client(base_url=llama_server.base_url, headers=headers, timeout=30) as client:
        for path, body, field in CASES:
            body = {**body, "stream": stream, "max_tokens": 4}
            if "model" not in body and path != "/generate":
                body["model"] = "tiny"
            response = client.post(path, content=json.dumps(body))
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()["error"]
            assert error["param"] == field and "UTF-8" in error["message"], (path, error)
        assert client.get("/health").status_code == 200
        answer = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "still here", "max_tokens": 4, "stream": stream},
        )
        assert answer.status_code == 200
    llama_server.wait_idle()


def test_every_error_has_openais_body_and_the_schema_says_400(llama_server):
    headers = {"authorization": "Bearer sk-test", "content-type": "application/json"}
    with httpx.Client(base_url=llama_server.base_url, headers=headers, timeout=30) as client:
        missing = client.get("/v1/nothing-here")
        wrong_method = client.get("/v1/completions")
        not_json = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": ')
        bools = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": [True, False], "max_tokens": 2}
        )
        bool_stop_ids = client.post(
            "/generate", json={"text": "hi", "sampling_params": {"stop_token_ids": [True]}}
        )
        not_finite = [
            client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": ' + v + b"}")
            for v in (b"NaN", b"Infinity")
        ]
        schema = client.get("/openapi.json").json()
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    error = not_json.json()["error"]
    assert (
        not_json.status_code == 400
        and error["param"] is None
        and "not valid JSON" in error["message"]
    )
    assert "at character" in error["message"]
    assert bools.status_code == 400 and bools.json()["error"]["param"].startswith("prompt")
    assert (
        bool_stop_ids.status_code == 400
        and "stop_token_ids" in bool_stop_ids.json()["error"]["param"]
    )
    for answer in not_finite:  # not JSON numbers, though Python's reader takes them
        assert answer.status_code == 400 and answer.json()["error"] == {
            "message": "temperature: Input should be a finite number",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_schema_nested_too_deep_for_a_json_reader_is_a_400(llama_server, path):
    # Python's reader gives up (RecursionError) where the schema compiler answers a 400
    schema = "[" * 200_000
    body = (
        {"text": "hi", "sampling_params": {"json_schema": schema, "max_new_tokens": 2}}
        if path == "/generate"
        else {"model": "tiny", "prompt": "hi", "json_schema": schema, "max_tokens": 2}
    )
    headers = {"authorization": "Bearer sk-test"}
    with httpx.Client(base_url=llama_server.base_url, headers=headers, timeout=30) as client:
        answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
