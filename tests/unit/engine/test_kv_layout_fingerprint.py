"""The fingerprint of a KV pool's layout (PoolLayout.fingerprint), which a prefill or decode
engine's /health tells the router (contract.KV_LAYOUT_HEADER) so that it pairs only engines
whose pools the bootstrap server would accept (PoolLayout.check_compatible) and of one
tensor-parallel size: equal configurations give equal ones, another model shape, KV element
type or tensor-parallel size another one."""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kubesgl import contract
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.kv_transfer import layout_of
from kubesgl.engine.ipc import Endpoints, pull
from kubesgl.engine.kvcache.pools import KVPool
from kubesgl.engine.messages import EngineInfo
from kubesgl.engine.scheduler.engine import Engine
from kubesgl.engine.scheduler.process import SchedulerLoop
from kubesgl.engine.server import api
from kubesgl.engine.server.context import ServerContext, ServerState, server_context

CPU = torch.device("cpu")


def _layout(slots=64, layers=2, kv_heads=2, head_dim=8, dtype=torch.bfloat16, agent="a"):
    return layout_of(KVPool(slots, layers, kv_heads, head_dim, dtype, CPU), agent)


SHAPES = {
    "base": {},
    "layers": {"layers": 3},
    "kv heads": {"kv_heads": 4},  # another model, or the same one at another TP size
    "head dim": {"head_dim": 16},
    "float32": {"dtype": torch.float32},
    "fp8": {"dtype": torch.float8_e4m3fn},
}


def test_pools_that_differ_in_what_the_bootstrap_server_compares_differ_in_fingerprint():
    layouts = {name: _layout(**shape) for name, shape in SHAPES.items()}
    prints = {name: layout.fingerprint(1) for name, layout in layouts.items()}
    assert len(set(prints.values())) == len(prints), prints
    # exactly where the bootstrap server would refuse the pair
    for la, lb in itertools.combinations(layouts.values(), 2):
        with pytest.raises(ValueError, match="KV pools differ"):
            la.check_compatible(lb)
    for fingerprint in prints.values():
        scheme, _, digest = fingerprint.partition("-")
        assert scheme == contract.KV_LAYOUT_SCHEME and len(digest) == 16


def test_the_tensor_parallel_size_is_part_of_the_fingerprint():
    layout = _layout()
    assert len({layout.fingerprint(tp) for tp in (1, 2, 4)}) == 3


def test_pools_the_bootstrap_server_pairs_have_one_fingerprint():
    """Slot counts, addresses, agents and memory differ between any two engines: none counts."""
    one, other = _layout(slots=64, agent="p"), _layout(slots=4096, agent="d")
    one.check_compatible(other)
    assert one.k_addresses != other.k_addresses
    assert one.fingerprint(2) == other.fingerprint(2)


def test_fingerprints_of_two_schemes_pair_and_of_one_scheme_only_when_equal():
    a, b = _layout().fingerprint(1), _layout(head_dim=16).fingerprint(1)
    assert contract.kv_layouts_pair(a, a) and not contract.kv_layouts_pair(a, b)
    assert contract.kv_layouts_pair(a, None) and contract.kv_layouts_pair(None, b)
    assert contract.kv_layouts_pair(a, "kv2-" + b.partition("-")[2])  # another version's way


@pytest.fixture
def make_engine():
    made: list[Engine] = []

    def make(model: str, role: str = contract.MIXED, **options) -> Engine:
        options = {"device": "cpu", "dtype": "float32", "max_total_tokens": 1024, **options}
        config = EngineConfig(model=model, role=role, disaggregation_bootstrap_port=0, **options)
        engine = Engine(config, bootstrap_host="127.0.0.1")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def test_engines_of_equal_configurations_have_equal_fingerprints_and_others_not(
    tiny_model, make_engine
):
    model = tiny_model("llama")

    def layout(model: str, **options) -> str | None:
        return make_engine(model, contract.DECODE, **options).kv_layout

    base = layout(model)
    assert base is not None
    assert layout(model, max_total_tokens=2048) == base  # another pool size
    assert layout(tiny_model("llama", seed=1)) == base  # other weights, one shape
    others = {
        "model shape": layout(tiny_model("llama", head_dim=32)),
        "dtype": layout(model, dtype="bfloat16"),
        "KV cache dtype": layout(model, kv_cache_dtype="fp8_e4m3"),
    }
    assert base not in others.values() and len(set(others.values())) == 3, others


def _engine_info(engine: Engine) -> EngineInfo:
    """What the scheduler's rank 0 tells the server at start (through the detokenizer)."""
    endpoints, context = Endpoints.create(), zmq.Context()
    inbox = pull(context, endpoints.detokenizer_in)
    loop = SchedulerLoop(engine, 0, endpoints, None, context, None)
    try:
        assert inbox.poll(5000)
        return inbox.recv_pyobj()
    finally:
        for socket in (inbox, loop.inbox, loop.outbox):
            socket.close(linger=0)
        context.term()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


def test_the_scheduler_tells_the_server_the_fingerprint_of_a_prefill_or_decode_engine(
    tiny_model, make_engine
):
    model = tiny_model("llama")
    prefill, decode = make_engine(model, contract.PREFILL), make_engine(model, contract.DECODE)
    assert prefill.kv_layout == decode.kv_layout
    assert _engine_info(prefill).kv_layout == prefill.kv_layout
    assert _engine_info(decode).kv_layout == decode.kv_layout
    assert _engine_info(make_engine(model)).kv_layout is None  # a mixed engine pairs with none


def _health(info: EngineInfo | None, ready: bool = True):
    client = SimpleNamespace(info=info, ready=asyncio.Event(), failure=None)
    if ready:
        client.ready.set()
    state = ServerState(EngineConfig(model="m", role=contract.DECODE), "m")
    app = FastAPI()
    app.include_router(api.health_routes)
    app.dependency_overrides[server_context] = lambda: ServerContext(client, state)  # type: ignore[arg-type]
    return TestClient(app).get("/health")


def test_health_names_the_layout_of_an_engine_that_has_one():
    info = EngineInfo("m", 4096, 1000, 8192, 1, "LlamaForCausalLM", [2], kv_layout="kv1-00ff")
    answer = _health(info)
    assert answer.status_code == 200 and answer.text == "ok"
    assert answer.headers[contract.KV_LAYOUT_HEADER] == "kv1-00ff"
    mixed = _health(EngineInfo("m", 4096, 1000, 8192, 1, "LlamaForCausalLM", [2]))
    assert mixed.status_code == 200 and contract.KV_LAYOUT_HEADER not in mixed.headers
    loading = _health(None, ready=False)
    assert loading.status_code == 503 and contract.KV_LAYOUT_HEADER not in loading.headers
