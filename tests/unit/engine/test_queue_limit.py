"""--max-queued-requests: an engine whose waiting queue is full refuses one more request with
a 503 that names the limit, so that a router sends it to another engine; a request that could
never run is still its 400, and a client request's sequences are queued or refused whole. The
engine a server runs (the offline LLM refuses the option)."""

from __future__ import annotations

import pytest
from test_scheduler import run_to_end, submit

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.scheduler.engine import Engine
from kubesgl.engine.server.errors import APIError


@pytest.fixture
def engine(tiny_model):
    config = EngineConfig(
        model=tiny_model("llama"),
        dtype="float32",
        device="cpu",
        max_total_tokens=16384,
        max_queued_requests=2,
        max_running_requests=1,
    )
    engine = Engine(config)
    yield engine
    engine.shutdown()


def test_a_request_beyond_the_queue_limit_is_a_503_naming_it(engine):
    for rid in ("a", "b"):
        submit(engine, rid, [1, 2, 3], max_tokens=4)
    with pytest.raises(InvalidRequestError) as refused:
        submit(engine, "c", [1, 2, 3], max_tokens=4)
    assert refused.value.status == 503
    assert "queue is full" in str(refused.value) and "--max-queued-requests 2" in str(refused.value)
    assert "c" not in engine.scheduler.requests
    outputs = run_to_end(engine)
    assert sorted(outputs) == ["a", "b"]
    submit(engine, "d", [1, 2, 3], max_tokens=4)  # the queue emptied: taken again
    assert [o.finish_reason.kind for o in run_to_end(engine)["d"] if o.finished] == ["length"]


def test_a_health_probe_is_taken_whatever_the_queue(engine):
    """/health_generate's probe on an engine merely busy: a 503 would take it out of a
    router's rotation (SGLang's router, users' probes)."""
    for rid in ("a", "b"):
        submit(engine, rid, [1, 2, 3], max_tokens=4)
    probe = GenerateRequest("health", [1], SamplingParams(max_tokens=1), probe=True)
    engine.add_request(probe)
    outputs = run_to_end(engine)
    assert [o.finish_reason.kind for o in outputs["health"] if o.finished] == ["length"]


def test_a_request_that_could_never_run_is_its_400_whatever_the_queue(engine):
    for rid in ("a", "b"):
        submit(engine, rid, [1, 2, 3], max_tokens=4)
    with pytest.raises(InvalidRequestError) as refused:
        submit(engine, "long", [1] * 100_000, max_tokens=4)
    assert refused.value.status == 400 and refused.value.param == "prompt"
    run_to_end(engine)


def test_the_sequences_of_one_client_request_are_queued_whole(engine):
    submit(engine, "a", [1, 2, 3], max_tokens=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(GenerateRequest("g-0", [4, 5, 6], params))
    for i in range(1, 5):  # more sequences than the queue takes, all behind their first
        engine.add_request(GenerateRequest(f"g-{i}", [4, 5, 6], params, request_leader="g-0"))
    finished = {rid for rid, outs in run_to_end(engine).items() if outs[-1].finished}
    assert finished == {"a", "g-0", "g-1", "g-2", "g-3", "g-4"}


def test_the_503_tells_a_client_when_to_try_again():
    response = APIError(503, "the request queue is full", "server_error").response()
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
