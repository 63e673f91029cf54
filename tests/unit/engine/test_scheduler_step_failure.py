"""A step that fails in a serving engine ends its own requests with a 500 and the engine serves
on; where going on is unsafe (several ranks, a device that no longer answers, failures in a
row) the scheduler process still exits, and the server with it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import zmq

from kubesgl.engine.ipc import Endpoints
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.process import MAX_FAILED_STEPS, SchedulerLoop


@pytest.fixture
def loop(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    endpoints, context = Endpoints.create(), zmq.Context()
    loop = SchedulerLoop(engine, 0, endpoints, None, context, None)
    yield loop
    loop.inbox.close(linger=0)
    loop.outbox.close(linger=0)
    context.term()
    shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


def fail_launches(monkeypatch, loop, count: int) -> None:
    """The next `count` steps fail as they are launched (a bug, or one request's bad input)."""
    executor = loop.engine.executor
    launch, left = executor.launch, [count]

    def failing(batch):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("the kernel failed")
        return launch(batch)

    monkeypatch.setattr(executor, "launch", failing)


def run_until_idle(loop) -> dict:
    ends = {}
    while loop.engine.has_work():
        for out in loop._step():
            if out.finish_reason is not None:
                ends[out.rid] = out
    return ends


def test_a_step_that_fails_ends_its_requests_and_the_next_request_is_served(loop, monkeypatch):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    loop.engine.add_request(GenerateRequest("unlucky", [1, 2, 3, 4], params))
    fail_launches(monkeypatch, loop, 1)
    assert loop._step() == []  # no exception: the process lives on
    ends = run_until_idle(loop)
    assert ends["unlucky"].finish_reason.kind == "error"
    assert ends["unlucky"].finish_reason.status == 500
    assert "the kernel failed" in ends["unlucky"].finish_reason.message
    loop.engine.add_request(GenerateRequest("next", [1, 2, 3, 4], params))
    ends = run_until_idle(loop)
    assert ends["next"].finish_reason.kind == "length" and loop.failed_steps == 0


def test_steps_that_fail_in_a_row_end_the_process(loop, monkeypatch):
    fail_launches(monkeypatch, loop, MAX_FAILED_STEPS)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(MAX_FAILED_STEPS - 1):
        loop.engine.add_request(GenerateRequest(f"r{i}", [1, 2, 3, 4], params))
        assert loop._step() == []
    loop.engine.add_request(GenerateRequest("last", [1, 2, 3, 4], params))
    with pytest.raises(RuntimeError, match="the kernel failed"):
        loop._step()
    run_until_idle(loop)  # what the failures ended is still handed out


def test_a_failed_step_ends_the_process_when_the_device_no_longer_answers(loop, monkeypatch):
    def gone() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(loop.engine, "check_device", gone)
    fail_launches(monkeypatch, loop, 1)
    loop.engine.add_request(GenerateRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop._step()
    run_until_idle(loop)


def test_a_failed_step_ends_the_process_with_several_ranks(loop, monkeypatch):
    # a rank that carried on alone could part ways with the others in their collectives
    monkeypatch.setattr(loop.engine, "config", dataclasses.replace(loop.engine.config, tp_size=2))
    fail_launches(monkeypatch, loop, 1)
    loop.engine.add_request(GenerateRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="the kernel failed"):
        loop._step()
    run_until_idle(loop)
