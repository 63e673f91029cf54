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
    # prompts of several chunks: a step launched behind the failed one (overlap) computes on
    # KV that was never written, which must not reach the prefix cache
    options = dict(
        disable_overlap_schedule=not overlap,
        chunked_prefill_size=8,
        page_size=1,  # a page per token: a chunk's KV is cached whole
    )
    # the reference from an engine of its own: the pages of this one then hold nothing that a
    # step which never ran could pass for its KV
    clean, llm = (make_llm(tiny_model("llama"), **options) for _ in range(2))
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

    prompt = list(range(5, 37))
    # logprobs: any KV that differs from a clean run's shows in them, if not in the tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    [expected] = clean.generate([prompt], params)
    executor.launch = launch_once_failing
    with pytest.raises(RuntimeError, match="failed this step"):
        llm.generate([prompt, [8, 9]], params)
    executor.launch = launch
    scheduler = llm.engine.scheduler
    for _ in range(3):  # idle turns: the failed requests' errors go out, then they are released
        scheduler.step()
    assert not scheduler.has_work() and not scheduler.requests
    [retried, _] = llm.generate([prompt, [8, 9]], params)
    assert retried.token_ids == expected.token_ids
    assert [t.logprob for t in retried.logprobs] == pytest.approx(
        [t.logprob for t in expected.logprobs], abs=1e-4
    )
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


def test_a_grammar_mask_that_fails_to_fill_ends_its_step_without_overlap(
    tiny_model, make_llm, monkeypatch
):
    # Filled before the step's launch there, outside the failure handling: its requests were
    # left scheduled, never launched nor ended, and their clients waited forever.
    llm = make_llm(tiny_model("llama"), disable_overlap_schedule=True)
    scheduler = llm.engine.scheduler
    fill = scheduler._fill_vocab_mask
    left = [1]

    def failing(batch):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("the matcher failed")
        fill(batch)

    monkeypatch.setattr(scheduler, "_fill_vocab_mask", failing)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid in ("a", "b"):
        llm.engine.add_request(GenerateRequest(rid, [5, 6, 7, 8], params))
    with pytest.raises(RuntimeError, match="the matcher failed"):
        llm.engine.step()
    ends = {}
    for _ in range(5):
        ends |= {out.rid: out.finish_reason for out in llm.engine.step() if out.finish_reason}
    assert {rid: reason.kind for rid, reason in ends.items()} == {"a": "error", "b": "error"}
    assert not scheduler.has_work() and not scheduler.requests
