"""SamplingParams built in Python (the offline LLM API) gets the same checks the server's
request models give: a wrong type is an InvalidRequestError naming the field, never a
TypeError from deep inside a step, and one bad request never breaks the engine."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.sampling_params import GrammarSpec, InvalidRequestError, SamplingParams


def test_a_stop_string_alone_is_one_stop_string():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("top_p", None),
        ("top_k", 2.5),
        ("min_p", "0"),
        ("seed", 1.5),
        ("seed", True),
        ("max_tokens", True),
        ("logprobs", 1.0),
        ("repetition_penalty", "1"),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 5),
        ("stop", [1]),
        ("ignore_eos", "yes"),
        ("grammar", GrammarSpec("json_schema", {"type": "object"})),  # type: ignore[arg-type]
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(vocab_size=1000)
    assert caught.value.param in (field, "response_format")


def test_ints_pass_where_floats_are_asked_for():
    SamplingParams(temperature=0, top_p=1, repetition_penalty=1, presence_penalty=0).validate(10)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["in the step", "at launch"])
def test_a_step_that_fails_does_not_break_the_next_generate(tiny_model, make_llm, overlap, where):
    llm = make_llm(tiny_model("llama"), disable_overlap_schedule=not overlap)
    executor = llm.engine.executor
    launch = executor.launch
    failures = [RuntimeError("the device failed this step")]

    def launch_once_failing(batch):
        if not failures:
            return launch(batch)
        if where == "at launch":
            raise failures.pop()
        failed = Future()
        failed.set_exception(failures.pop())
        return failed

    prompt, params = [5, 6, 7], SamplingParams(max_tokens=4, temperature=0)
    [expected] = llm.generate([prompt], params)
    executor.launch = launch_once_failing
    with pytest.raises(RuntimeError, match="failed this step"):
        llm.generate([prompt, [8, 9]], params)
    executor.launch = launch
    assert llm.generate([prompt, [8, 9]], params)[0].token_ids == expected.token_ids
    scheduler = llm.engine.scheduler
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
