"""vLLM's /version, /tokenize and /detokenize, served by the engine in vLLM's shapes: the
tokens are the tokenizer process's, the very ones a generation request with the prompt gets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import zmq
import zmq.asyncio

from kubesgl import __version__
from kubesgl.contract import MAX_BODY_DEPTH
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import EngineInfo
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerState
from kubesgl.engine.server.engine_client import EngineClient
from kubesgl.engine.tokenizer.loader import load_tokenizer
from kubesgl.engine.tokenizer.process import Tokenizer, TokenizerLoop
from kubesgl.router.errors import RouterError
from kubesgl.router.request_parsing import parse_generation_request

pytestmark = pytest.mark.asyncio
CONTEXT = 64  # the engine's context length here: max_model_len, and the bound of the limits
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


class ReadyClient:
    """What the routes use of an EngineClient whose engine is ready."""

    def __init__(self):
        self.metrics = EngineMetrics("mixed")
        self.ready = asyncio.Event()
        self.failure = None  # the engine runs
        self.ready.set()
        self.info = SimpleNamespace(vocab_size=1000, context_length=4096, max_total_tokens=8192)


def http(client, model: str = "m", api_key: str | None = None) -> httpx.AsyncClient:
    state = ServerState(EngineConfig(model=model), "tiny", api_key=api_key)
    transport = httpx.ASGITransport(app=build_app(client, state))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://engine")


async def test_version_is_kubesgls_as_vllm_shapes_it_and_needs_no_key():
    async with http(ReadyClient(), api_key="secret") as engine:
        response = await engine.get("/version")
    assert response.status_code == 200 and response.json() == {"version": __version__}


@contextlib.asynccontextmanager
async def engine_of(
    model: str, api_key: str | None = None, context_length: int = CONTEXT
) -> AsyncIterator[httpx.AsyncClient]:
    """The engine's app over a real EngineClient and the tokenizer process's loop, run in this
    event loop; no scheduler (nothing here generates)."""
    endpoints = Endpoints.create()
    client = EngineClient(endpoints, EngineMetrics("mixed"))
    client.start()
    context = zmq.asyncio.Context()
    from_api = pull(context, endpoints.tokenizer_in)
    to_api = push(zmq.Context.instance(), endpoints.api_in)
    loop = TokenizerLoop(Tokenizer(model), SimpleNamespace(send_pyobj=lambda m: None), to_api)

    async def tokenizer_process() -> None:
        while loop.from_api(await from_api.recv_pyobj()):
            pass

    tokenizer = asyncio.create_task(tokenizer_process())
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    to_api.send_pyobj(
        EngineInfo(model, context_length, vocab_size, 1000, 1, "LlamaForCausalLM", [2])
    )
    try:
        await asyncio.wait_for(client.ready.wait(), 5)
        async with http(client, model, api_key) as engine:
            yield engine
    finally:
        tokenizer.cancel()
        await client.shutdown()
        to_api.close(linger=0)
        context.destroy(linger=0)
        await client.aclose()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.fixture(scope="module")
def bos_model(tiny_model, tmp_path_factory) -> str:
    """The tiny llama with a tokenizer that starts every text with a BOS token (the tiny one
    adds no special token): add_special_tokens then makes a difference."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing

    path = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_model("llama"), path)
    rust = RustTokenizer.from_file(str(path / "tokenizer.json"))
    bos = "<|endoftext|>"
    rust.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, rust.token_to_id(bos))]
    )
    rust.save(str(path / "tokenizer.json"))
    return str(path)


async def test_a_prompts_tokens_with_and_without_special_tokens(bos_model):
    hf = load_tokenizer(bos_model)
    async with engine_of(bos_model) as engine:
        default = await engine.post("/tokenize", json={"model": "tiny", "prompt": "hello world"})
        bare = await engine.post(
            "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}
        )
    with_bos = hf.encode("hello world", add_special_tokens=True)
    assert default.status_code == 200, default.text
    assert default.json() == {"count": len(with_bos), "max_model_len": CONTEXT, "tokens": with_bos}
    assert (
        bare.json()["tokens"] == with_bos[1:] == hf.encode("hello world", add_special_tokens=False)
    )


async def test_chat_messages_count_as_the_chat_template_renders_them(bos_model):
    """As a chat completion's prompt: the template's tokens, no BOS beyond what it writes,
    unless add_special_tokens; the template's controls and variables taken as chat takes them."""
    hf = load_tokenizer(bos_model)
    render = lambda **kw: hf.apply_chat_template(CHAT, tokenize=False, **kw)  # noqa: E731
    async with engine_of(bos_model) as engine:
        chat = (await engine.post("/tokenize", json={"messages": CHAT})).json()
        no_turn = await engine.post(
            "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
        )
        special = await engine.post(
            "/tokenize", json={"messages": CHAT, "add_special_tokens": True}
        )
        thinking_off = await engine.post(
            "/tokenize",
            json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}},
        )
    prompt = render(add_generation_prompt=True)
    assert chat["tokens"] == hf.encode(prompt, add_special_tokens=False)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == CONTEXT
    assert no_turn.json()["tokens"] == hf.encode(
        render(add_generation_prompt=False), add_special_tokens=False
    )
    assert special.json()["tokens"] == hf.encode(prompt, add_special_tokens=True)
    assert thinking_off.json()["tokens"] == hf.encode(
        render(add_generation_prompt=True, enable_thinking=False), add_special_tokens=False
    )


async def test_detokenize_gives_the_tokens_text(tiny_model):
    hf = load_tokenizer(tiny_model("llama"))
    tokens = hf.encode("🙂 naïve café", add_special_tokens=False)
    async with engine_of(tiny_model("llama")) as engine:
        text = await engine.post("/detokenize", json={"model": "tiny", "tokens": tokens})
        empty = await engine.post("/detokenize", json={"tokens": []})
    assert text.status_code == 200 and text.json() == {"prompt": "🙂 naïve café"}
    assert empty.json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model", "does not exist"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model", "does not exist"),
        ("/tokenize", {"model": "tiny"}, 400, None, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, None, "exactly one of"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
        ("/tokenize", {"prompt": 3}, 400, "prompt", "valid string"),
        ("/tokenize", {"prompt": "x" * (16 * CONTEXT + 1)}, 400, "prompt", "characters"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "return_token_strs", ""),
        (
            "/tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}},
            400,
            "chat_template_kwargs",
            "may not set 'tokenize'",
        ),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True},
            400,
            "continue_final_message",
            "cannot both be true",
        ),
        ("/detokenize", {}, 400, "tokens", "Field required"),
        ("/detokenize", {"tokens": [1, 636]}, 400, "tokens", "outside the vocabulary (size 636)"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens.1", "valid integer"),
        ("/detokenize", {"tokens": [1] * (CONTEXT + 1)}, 400, "tokens", "context length"),
    ],
)
async def test_bad_requests_are_refused_with_openais_error_body(
    tiny_model, path, body, status, param, words
):
    async with engine_of(tiny_model("llama")) as engine:
        response = await engine.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param, error
    assert words in error["message"]


async def test_an_engine_without_a_tokenizer_says_so(tiny_model, tmp_path):
    path = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model("llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    async with engine_of(str(path)) as engine:
        answers = [
            await engine.post("/tokenize", json={"prompt": "hi"}),
            await engine.post("/tokenize", json={"messages": CHAT}),
            await engine.post("/detokenize", json={"tokens": [1, 2]}),
        ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert "this model has no tokenizer" in answer.json()["error"]["message"]


async def test_tokenize_and_detokenize_need_the_key(tiny_model):
    async with engine_of(tiny_model("llama"), api_key="secret") as engine:
        refused = await engine.post("/tokenize", json={"prompt": "hi"})
        taken = await engine.post(
            "/detokenize", json={"tokens": [5]}, headers={"Authorization": "Bearer secret"}
        )
    assert refused.status_code == 401 and taken.status_code == 200


async def test_an_unknown_route_or_method_is_named_as_the_router_names_it():
    """Starlette's words were "Not Found" and "Method Not Allowed", and the 405 had no Allow."""
    async with http(ReadyClient()) as engine:
        missing = await engine.post("/v1/embeddings", json={"input": "hi"})
        wrong_method = await engine.put("/v1/completions")
        not_served = await engine.post("/v1/responses", json={})
    assert missing.status_code == 404 and missing.json()["error"] == {
        "message": "no route for POST /v1/embeddings",
        "type": "not_found_error",
        "param": None,
        "code": None,
    }
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["message"] == "/v1/completions accepts POST"
    assert "Responses API" in not_served.json()["error"]["message"]  # the routes it names


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_a_body_that_is_not_utf8_is_named_as_the_router_names_it(path):
    """FastAPI's words were "There was an error parsing the body"; the router's name the byte
    and where it is."""
    body = b'{"model": "tiny", "prompt": "\xff\xfe"}'
    async with http(ReadyClient()) as engine:
        answer = await engine.post(path, content=body, headers={"content-type": "application/json"})
    with pytest.raises(RouterError) as routed:
        parse_generation_request(path, body)
    assert answer.status_code == 400 and answer.json()["error"] == {
        "message": routed.value.message,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert "can't decode byte 0xff in position 29" in routed.value.message


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_parameters(depth: int) -> dict:
    value: dict = {"type": "object"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "deep",
    [
        {"chat_template_kwargs": {"x": nested(900)}},
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": deep_parameters(250)}}
            ]
        },
    ],
    ids=["chat_template_kwargs", "tools"],
)
async def test_a_body_nested_too_deeply_is_a_400_naming_the_problem(tiny_model, path, deep):
    """Python's JSON reader takes it, but sending it on to the tokenizer (pickle) did not:
    a 500, not to be retried. The request is refused before anything is sent."""
    async with engine_of(tiny_model("llama"), context_length=4096) as engine:  # the prompt fits
        refused = await engine.post(path, json={"messages": CHAT, **deep})
        unreadable = await engine.post(  # past what Python's JSON reader takes
            path,
            content=f'{{"messages": {json.dumps(CHAT)}, "x": {"[" * 1100}{"]" * 1100}}}',
            headers={"content-type": "application/json"},
        )
        past_the_limit = await engine.post(
            "/tokenize",
            json={"messages": CHAT, "chat_template_kwargs": {"x": nested(MAX_BODY_DEPTH - 1)}},
        )
        at_the_limit = await engine.post(
            "/tokenize",
            json={"messages": CHAT, "chat_template_kwargs": {"x": nested(MAX_BODY_DEPTH - 2)}},
        )
    for answer in (refused, unreadable, past_the_limit):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == (
            f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} deep"
        )
    assert at_the_limit.status_code == 200, at_the_limit.text


async def test_only_a_json_body_a_route_reads_is_checked_for_depth(tiny_model):
    """A route without a body ignores one, deep or not; a body that is not JSON gets its own
    answer, not the depth's (both were read for the depth check, and refused)."""
    deep = json.dumps({"x": nested(MAX_BODY_DEPTH + 1)})
    async with engine_of(tiny_model("llama")) as engine:
        models = await engine.request(
            "GET", "/v1/models", content=deep, headers={"content-type": "application/json"}
        )
        text = await engine.post(
            "/v1/completions", content=deep, headers={"content-type": "text/plain"}
        )
    assert models.status_code == 200, models.text
    assert "nests arrays and objects" not in text.text


async def test_only_an_engine_going_away_is_the_tokenizer_calls_own_500():
    """Its 500 quotes why the engine's processes went away; another RuntimeError is a bug,
    left to the server's crash answer, which names its kind and never its message."""
    from kubesgl.engine.server.api import tokenizer_answer
    from kubesgl.engine.server.engine_client import EngineGone
    from kubesgl.engine.server.errors import APIError

    async def call(error: Exception) -> None:
        async def tokenizer_call(prompt, token_ids):
            raise error

        ctx = SimpleNamespace(client=SimpleNamespace(tokenizer_call=tokenizer_call))
        await tokenizer_answer(ctx, token_ids=[5])  # type: ignore[arg-type]

    with pytest.raises(APIError) as answered:
        await call(EngineGone("the tokenizer died"))
    assert (answered.value.status, answered.value.message) == (500, "the tokenizer died")
    with pytest.raises(RuntimeError, match="a bug"):
        await call(RuntimeError("a bug"))
