"""A step that fails in a serving engine ends its own requests with a 500 and the engine serves
on; where going on is unsafe (several ranks, a device that no longer answers, failures in a
row) the scheduler process still exits, and the server with it."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from kubesgl.engine.ipc import Endpoints
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.process import MAX_FAILED_STEPS, SchedulerLoop


@contextmanager
def serving_loop(engine) -> Iterator[SchedulerLoop]:
    endpoints, context = Endpoints.create(), zmq.Context()
    loop = SchedulerLoop(engine, 0, endpoints, None, context, None)
    try:
        yield loop
    finally:
        loop.inbox.close(linger=0)
        loop.outbox.close(linger=0)
        context.term()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.fixture
def loop(tiny_model, make_llm):
    with serving_loop(make_llm(tiny_model("llama")).engine) as loop:
        yield loop


def fail_steps(monkeypatch, loop, count: int) -> list[int]:
    """The next `count` forward passes raise (a bug, or one request's bad input), on the
    executor's thread as on a device: the scheduler hears of it when it processes the step.
    Returns the count left, which a test may set to 0."""
    runner = loop.engine.executor.runner
    run, left = runner.run, [count]

    def failing(batch):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("the kernel failed")
        return run(batch)

    monkeypatch.setattr(runner, "run", failing)
    return left


def run_until_idle(loop) -> dict:
    ends = {}
    while loop.engine.has_work():
        for out in loop._step():
            if out.finish_reason is not None:
                ends[out.rid] = out
    return ends


def params() -> SamplingParams:
    return SamplingParams(max_tokens=3, ignore_eos=True)


def test_a_step_that_fails_ends_its_requests_and_the_next_request_is_served(loop, monkeypatch):
    loop.engine.add_request(GenerateRequest("unlucky", [1, 2, 3, 4], params()))
    fail_steps(monkeypatch, loop, 1)
    ends = run_until_idle(loop)  # no exception: the process lives on
    assert ends["unlucky"].finish_reason.kind == "error"
    assert ends["unlucky"].finish_reason.status == 500
    assert "the kernel failed" in ends["unlucky"].finish_reason.message
    loop.engine.add_request(GenerateRequest("next", [1, 2, 3, 4], params()))
    ends = run_until_idle(loop)
    assert ends["next"].finish_reason.kind == "length" and loop.failed_steps == 0


def test_steps_that_fail_in_a_row_end_the_process(loop, monkeypatch):
    left = fail_steps(monkeypatch, loop, 100)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        for turn in range(4 * MAX_FAILED_STEPS):
            loop.engine.add_request(GenerateRequest(f"r{turn}", [1, 2, 3, 4], params()))
            loop._step()
    assert loop.failed_steps == MAX_FAILED_STEPS
    left[0] = loop.failed_steps = 0  # the step in flight, if any, still fails: one in a row
    run_until_idle(loop)  # what the failures ended is still handed out


def test_an_error_whose_requests_were_not_ended_ends_the_process_at_once(loop, monkeypatch):
    # raised before any batch was made: the scheduler ended nothing for it, and requests it
    # half scheduled could wait forever in an engine that went on
    def broken() -> None:
        raise RuntimeError("a bug in scheduling")

    monkeypatch.setattr(loop.engine.scheduler, "_schedule", broken)
    loop.engine.add_request(GenerateRequest("r", [1, 2, 3, 4], params()))
    with pytest.raises(RuntimeError, match="a bug in scheduling"):
        loop._step()
    assert loop.failed_steps == 1
    monkeypatch.undo()
    run_until_idle(loop)


def raises_within_a_few_turns(loop, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        for _ in range(4):  # with overlap, a step's failure is heard a turn later
            loop._step()


def test_a_failed_step_ends_the_process_when_the_device_no_longer_answers(loop, monkeypatch):
    def gone() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(loop.engine, "check_device", gone)
    fail_steps(monkeypatch, loop, 1)
    loop.engine.add_request(GenerateRequest("r", [1, 2, 3, 4], params()))
    raises_within_a_few_turns(loop, "illegal memory access")
    run_until_idle(loop)


def test_a_failed_step_ends_the_process_with_several_ranks(loop, monkeypatch):
    # a rank that carried on alone could part ways with the others in their collectives
    monkeypatch.setattr(loop.engine, "config", dataclasses.replace(loop.engine.config, tp_size=2))
    fail_steps(monkeypatch, loop, 1)
    loop.engine.add_request(GenerateRequest("r", [1, 2, 3, 4], params()))
    raises_within_a_few_turns(loop, "the kernel failed")
    run_until_idle(loop)


def test_a_step_that_fails_while_drained_for_a_retraction_is_contained(
    make_llm, tiny_model, monkeypatch
):
    # A pool too small for its decodes: the step in flight is finished early so that requests
    # can be retracted, and it is that step which fails.
    engine = make_llm(tiny_model("llama"), max_total_tokens=128, page_size=1).engine
    scheduler, failed = engine.scheduler, []
    fit_decode = scheduler._fit_decode

    def fail_the_step_in_flight(ready):
        if not failed and scheduler._in_flight and scheduler.kv.pages_short(ready) > 0:
            batch, _ = scheduler._in_flight
            future: Future = Future()
            future.set_exception(RuntimeError("the kernel failed"))
            scheduler._in_flight = (batch, future)
            failed.append(batch.reqs)
        return fit_decode(ready)

    monkeypatch.setattr(scheduler, "_fit_decode", fail_the_step_in_flight)
    with serving_loop(engine) as loop:
        for i in range(6):
            sampling = SamplingParams(max_tokens=60, ignore_eos=True)
            engine.add_request(GenerateRequest(f"r{i}", [5 + i] * 10, sampling))
        ends = run_until_idle(loop)  # no exception: the process lives on
        assert failed, "no retraction happened: the pool is not small enough"
        assert {ends[r.rid].finish_reason.kind for r in failed[0]} == {"error"}
        assert len(ends) == 6  # the others served on
        scheduler.check_integrity()
