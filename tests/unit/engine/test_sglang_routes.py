"""SGLang's metadata routes on their own (sglang_routes.routes in a bare app, the request
context given as a dependency override): what SGLang's router and tools read of them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kubesgl import __version__
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.messages import EngineInfo
from kubesgl.engine.server import sglang_routes
from kubesgl.engine.server.context import ServerContext, ServerState, server_context

INFO = EngineInfo("m", 4096, 1000, 8192, 1, "LlamaForCausalLM", [2])


def _routes_alone(info: EngineInfo | None, stats: SimpleNamespace | None) -> TestClient:
    client = SimpleNamespace(info=info, stats=stats, ready=asyncio.Event(), failure=None)
    config = EngineConfig(model="/models/m", role="prefill", context_length=2048)
    state = ServerState(config, "served-name")
    app = FastAPI()
    app.include_router(sglang_routes.routes)
    app.dependency_overrides[server_context] = lambda: ServerContext(client, state)  # type: ignore[arg-type]
    return TestClient(app)


def test_model_info_names_the_served_model_under_both_paths():
    http = _routes_alone(INFO, None)
    for path in ("/model_info", "/get_model_info"):
        answer = http.get(path).json()
        assert answer["served_model_name"] == "served-name"
        assert answer["model_path"] == answer["tokenizer_path"] == "/models/m"
        assert answer["architectures"] == ["LlamaForCausalLM"]
        assert (answer["max_context_length"], answer["max_req_input_len"]) == (4096, 4095)
        assert (answer["vocab_size"], answer["eos_token_ids"]) == (1000, [2])


def test_server_info_before_the_model_is_loaded_gives_the_configured_context():
    http = _routes_alone(None, None)
    for path in ("/server_info", "/get_server_info"):
        answer = http.get(path).json()
        assert answer["disaggregation_mode"] == "prefill"
        assert answer["context_length"] == 2048
        assert (answer["max_total_num_tokens"], answer["version"]) == (None, __version__)


def test_get_load_counts_running_and_waiting_requests():
    stats = SimpleNamespace(num_running=2, num_waiting=3, kv_used_tokens=77)
    assert _routes_alone(INFO, stats).get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 77}
    ]
    assert _routes_alone(INFO, None).get("/get_load").json()[0]["num_reqs"] == 0
