"""Hostile values in every string field of every endpoint: each is a 400 that names the
field, and the engine goes on serving (a lone surrogate, what a JavaScript client sends when
it cuts an emoji in half, used to crash the whole engine)."""

from __future__ import annotations

import json

import httpx
import pytest

SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800", as a JavaScript client does

CASES = [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a" + SURROGATE]}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "stop": SURROGATE}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", SURROGATE]}, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "model": SURROGATE}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": SURROGATE}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [SURROGATE]}, "stop.0"),
    ("/generate", {"text": SURROGATE}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": SURROGATE}}, "sampling_params.stop"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x", SURROGATE]}}, "sampling_params.stop.1"),
    ("/generate", {"text": "hi", "rid": SURROGATE}, "rid"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_text_that_is_not_utf8_is_a_400_naming_the_field_and_the_engine_goes_on(llama_server, stream):
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
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "still here", "max_tokens": 4,
                                                      "stream": stream})
        assert answer.status_code == 200
    llama_server.wait_idle()
