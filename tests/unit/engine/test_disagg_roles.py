"""The prefill and decode roles of the scheduler, in one process: a prefill engine and a
decode engine on the same tiny model, KV moved over NIXL (UCX on host memory), driven
turn by turn as their scheduler loops would drive them."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import pytest

from kubesgl.engine import SamplingParams
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.protocol import BootstrapTarget
from kubesgl.engine.engine import Engine
from kubesgl.engine.io import GenerateRequest

_rooms = itertools.count(1)


@pytest.fixture
def make_engine():
    made = []

    def make(model: str, role: str, **options) -> Engine:
        options = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, **options}
        engine = Engine(EngineConfig(model=model, role=role, disaggregation_bootstrap_port=0, **options),
                        bootstrap_host="127.0.0.1")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def run(engines, until, timeout: float = 60.0) -> dict[str, list]:
    """Step every engine until `until(outputs)`; returns every output per request id."""
    outputs = defaultdict(list)
    deadline = time.monotonic() + timeout
    while not until(outputs):
        assert time.monotonic() < deadline, f"timed out with {dict(outputs)}"
        for engine in engines:
            for out in engine.step():
                outputs[out.rid].append(out)
        time.sleep(0.0005)
    return outputs


def finished(rids):
    return lambda outputs: all(outputs[r] and outputs[r][-1].finished for r in rids)


def pd_generate(prefill: Engine, decode: Engine, prompts, params: SamplingParams, port: int | None = None):
    port = port or prefill.role.transfers.server.port
    rids = []
    for i, prompt in enumerate(prompts):
        target = BootstrapTarget(next(_rooms), "127.0.0.1", port)
        decode.add_request(GenerateRequest(f"d{i}", prompt, params, bootstrap=target))
        prefill.add_request(GenerateRequest(f"p{i}", prompt, params, bootstrap=target))
        rids += [f"d{i}", f"p{i}"]
    return run([prefill, decode], finished(rids))


def tokens(outputs, rid):
    return [t for out in outputs[rid] for t in out.token_ids]


def assert_idle(*engines):
    for engine in engines:
        scheduler = engine.scheduler
        scheduler.drain()
        scheduler.check_integrity()
        assert not scheduler.has_work()
        assert scheduler.kv.committed_tokens() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_output_through_prefill_and_decode_equals_a_mixed_engine(arch, page_size, tiny_model, make_engine,
                                                                        random_prompts):
    model = tiny_model(arch)
    options = {"page_size": page_size, "chunked_prefill_size": 32}
    mixed = make_engine(model, "mixed", **options)
    prefill, decode = make_engine(model, "prefill", **options), make_engine(model, "decode", **options)
    prompts = random_prompts(6, 3, 90, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        mixed.add_request(GenerateRequest(f"m{i}", prompt, params))
    reference = run([mixed], finished([f"m{i}" for i in range(len(prompts))]))
    outputs = pd_generate(prefill, decode, prompts, params)
    for i in range(len(prompts)):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
        assert outputs[f"d{i}"][-1].finish_reason.kind == "length"
        assert tokens(outputs, f"p{i}") == tokens(reference, f"m{i}")[:1]  # the prefill answer: the first token
    assert_idle(prefill, decode)
