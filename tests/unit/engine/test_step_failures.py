"""A step that fails (the device, or a bug) ends its requests with an error and leaves an
engine that serves the next ones; shutdown frees it all the same; a request whose grammar
cannot start compiling leaves nothing behind."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.sampling_params import GrammarSpec, SamplingParams


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["in the step", "at launch"])
@pytest.mark.parametrize("failing_launch", [1, 3])  # the third: a step is in flight (overlap)
def test_a_step_that_fails_does_not_break_the_next_generate(
    tiny_model, make_llm, overlap, where, failing_launch
):
    llm = make_llm(tiny_model("llama"), disable_overlap_schedule=not overlap)
    executor = llm.engine.executor
    launch = executor.launch
    launches = 0

    def launch_once_failing(batch):
        nonlocal launches
        launches += 1
        if launches != failing_launch:
            return launch(batch)
        error = RuntimeError("the device failed this step")
        if where == "at launch":
            raise error
        failed = Future()
        failed.set_exception(error)
        return failed

    prompt, params = [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)
    [expected] = llm.generate([prompt], params)
    executor.launch = launch_once_failing
    with pytest.raises(RuntimeError, match="failed this step"):
        llm.generate([prompt, [8, 9]], params)
    executor.launch = launch
    scheduler = llm.engine.scheduler
    for _ in range(3):  # idle turns: the failed requests' errors go out, then they are released
        scheduler.step()
    assert not scheduler.has_work() and not scheduler.requests
    assert llm.generate([prompt, [8, 9]], params)[0].token_ids == expected.token_ids
    scheduler.drain()
    assert not scheduler.has_work() and not scheduler.requests


def test_shutdown_frees_the_engine_even_if_the_step_in_flight_failed(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    engine.add_request(GenerateRequest("r", [5, 6, 7], SamplingParams(max_tokens=8)))
    engine.executor.launch = lambda batch: _failed(RuntimeError("the device failed"))
    engine.step()  # launched; with overlap it fails when processed, at shutdown
    llm.shutdown()
    assert not hasattr(engine.executor, "runner") and not hasattr(engine, "model")


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def test_a_request_whose_grammar_cannot_start_compiling_leaves_nothing_behind(
    tiny_model, make_llm, monkeypatch
):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine

    def broken(spec):
        raise RuntimeError("the compiler pool is gone")

    monkeypatch.setattr(engine.scheduler.grammars, "compile", broken)
    params = SamplingParams(max_tokens=4, grammar=GrammarSpec("json_object"))
    with pytest.raises(RuntimeError, match="pool is gone"):
        engine.add_request(GenerateRequest("g", [5, 6, 7], params))
    assert "g" not in engine.scheduler.requests
    assert engine.abort_request("g", "the client left") == []
