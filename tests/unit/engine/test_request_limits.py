"""What one request may ask of the server (issue 11, item 4), the engine's default address and
where its API key comes from (item 6), without starting an engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml
from fastapi import FastAPI, Request

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams, check_prompt_tokens
from kubesgl.engine.server.api_key import API_KEY_ENV, resolve_api_key
from kubesgl.engine.server.limits import (
    BodyLimit,
    check_prompt_chars,
    check_sequences,
    check_stop_strings,
)
from kubesgl.engine.server.options import ServerOptions, build_parser

LIMIT = 4096


def _echo_app() -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    seen: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    return app, seen


def _post(app, content) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=BodyLimit(app, LIMIT))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post("/echo", content=content)

    return asyncio.run(go())


def _chunks(size: int, chunk: int = 1000):
    async def gen():
        for start in range(0, size, chunk):
            yield b"x" * min(chunk, size - start)

    return gen()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_with_openais_body_and_never_reaches_the_app(chunked):
    app, seen = _echo_app()
    response = _post(app, _chunks(LIMIT + 1) if chunked else b"x" * (LIMIT + 1))
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "--max-request-body-bytes" in error["message"] and str(LIMIT) in error["message"]
    assert seen == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_within_the_limit_reaches_the_app_whole(chunked):
    app, seen = _echo_app()
    response = _post(app, _chunks(LIMIT) if chunked else b"x" * LIMIT)
    assert response.status_code == 200 and response.json() == {"bytes": LIMIT} and seen == [LIMIT]


def test_the_sequences_of_a_request_are_its_prompts_times_n():
    config = EngineConfig(model="m", max_sequences_per_request=256)
    check_sequences(config, 4, 64)
    check_sequences(config, 256, 1)
    with pytest.raises(InvalidRequestError) as caught:
        check_sequences(config, 500, 64)
    assert caught.value.param == "n" and "32000" in str(caught.value)
    with pytest.raises(InvalidRequestError) as caught:
        check_sequences(config, 257, 1)
    assert caught.value.param == "prompt"


def test_a_stop_string_over_the_limit_is_refused():
    config = EngineConfig(model="m", max_stop_string_length=1024)
    check_stop_strings(config, SamplingParams(stop=["x" * 1024] * 16))
    with pytest.raises(InvalidRequestError) as caught:
        check_stop_strings(config, SamplingParams(stop=["ok", "x" * 100_000]))
    assert caught.value.param == "stop" and "100000" in str(caught.value)


def test_a_prompt_is_refused_by_its_characters_before_it_is_tokenized():
    config = EngineConfig(model="m", max_prompt_chars_per_token=16)
    check_prompt_chars(config, 2048, 2048 * 16, "prompt")
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_chars(config, 2048, 5_000_000, "prompt.3")
    assert caught.value.param == "prompt.3" and "32768" in str(caught.value)


def test_a_token_id_prompt_that_leaves_no_room_for_an_output_is_refused():
    check_prompt_tokens(2048, 2047, "input_ids")
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_tokens(2048, 2048, "prompt.1")
    assert caught.value.param == "prompt.1" and "2048 tokens long" in str(caught.value)


def test_the_defaults_are_generous():
    config = EngineConfig(model="m")
    assert config.max_sequences_per_request >= 128  # OpenAI's largest n
    assert (
        config.max_request_body_bytes >= 8 * 1024 * 1024
    )  # a 1M-token prompt as text, 128K as token ids
    assert config.max_prompt_chars_per_token >= 8  # text averages about 4 characters per token
    assert config.max_stop_string_length >= 256


def test_the_engine_listens_on_loopback_unless_told_otherwise():
    assert ServerOptions().host == "127.0.0.1"
    assert build_parser().parse_args(["--model", "m"]).host == "127.0.0.1"


def test_the_rendered_engine_pods_listen_on_every_address():
    from pathlib import Path

    from kubesgl.operator.render import render
    from kubesgl.operator.validation import parse_inference_service

    isvc = yaml.safe_load(
        (Path(__file__).resolve().parents[3] / "examples" / "mixed.yaml").read_text()
    )
    for obj in render(parse_inference_service(isvc)):
        if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith("-mixed"):
            args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
            assert build_parser().parse_args(args[1:]).host == "0.0.0.0"


def _key(argv: list[str], environ: dict[str, str]) -> str | None:
    return resolve_api_key(build_parser().parse_args(["--model", "m", *argv]), environ)


def test_the_api_key_comes_from_the_flag_then_a_file_then_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    env = {API_KEY_ENV: "sk-env"}
    assert _key([], {}) is None
    assert _key([], env) == "sk-env"
    assert _key(["--api-key-file", str(key_file)], env) == "sk-file"
    assert _key(["--api-key", "sk-flag"], env) == "sk-flag"


@pytest.mark.parametrize(
    ("argv", "environ", "problem"),
    [
        (["--api-key", "a", "--api-key-file", "f"], {}, "not both"),
        (["--api-key-file", "/nonexistent/key"], {}, "cannot read"),
        ([], {API_KEY_ENV: ""}, "empty"),
        (["--api-key", ""], {}, "empty"),
    ],
)
def test_an_api_key_that_cannot_be_used_stops_the_server(argv, environ, problem):
    with pytest.raises(ValueError, match=problem):
        _key(argv, environ)


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        ([], {API_KEY_ENV: "sk-1\n"}),  # a Secret made from a file
        (["--api-key", " sk-1"], {}),
        ([], {API_KEY_ENV: "sk-\u00e9"}),
    ],
)
def test_an_api_key_no_client_could_send_stops_the_server(argv, environ, tmp_path):
    """A header value loses its surrounding whitespace and holds only printable ASCII: the
    engine required such a key as it was and answered every request 401, while the router,
    given the same Secret, refused it at start. Now both refuse it; a file's key is stripped
    first, as before."""
    with pytest.raises(ValueError, match="no client could send this key in a header"):
        _key(argv, environ)
    key_file = tmp_path / "key"
    key_file.write_text("sk-1\n")
    assert _key(["--api-key-file", str(key_file)], {}) == "sk-1"
    key_file.write_text("sk\x01x\n")
    with pytest.raises(ValueError, match="no client could send this key in a header"):
        _key(["--api-key-file", str(key_file)], {})


def test_the_api_key_is_in_no_repr():
    from kubesgl.engine.server.context import ServerState

    assert "sk-secret" not in repr(ServerOptions(api_key="sk-secret"))
    assert "sk-secret" not in repr(ServerState(EngineConfig(model="m"), "m", api_key="sk-secret"))
