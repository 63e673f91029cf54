"""Constrained decoding: every output of a grammar request parses, in every sampling mode, with
overlap on and off, chunked prefill and the radix cache; requests without a grammar in the same
batch are untouched; the mask of each step follows the token of the step before."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from json_schemas import SCHEMAS

from kubesgl.engine import SamplingParams
from kubesgl.engine.sampling_params import GrammarSpec, InvalidRequestError

MODES = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=1.0, seed=7),
    "top-k-top-p-min-p": dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=3),
    "penalties": dict(
        temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5
    ),
}
PROMPTS = ["Give me JSON.", "a b c", "Once upon a time", "x"]


def _schema_params(name: str, max_tokens: int = 120, **mode) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS[name])), **mode
    )


def _assert_valid(out, schema: dict) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    try:
        answer = json.loads(out.text)  # strict: no raw control characters in a string
    except ValueError as exc:
        raise AssertionError(f"{out.text!r} {out.token_ids}") from exc
    jsonschema.validate(answer, schema)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_answer_validates_in_every_sampling_mode(llama, make_llm, overlap, page_size):
    llm = make_llm(llama, disable_overlap_schedule=not overlap, page_size=page_size)
    cases = [(schema, mode) for schema in SCHEMAS for mode in MODES]
    params = [_schema_params(schema, **MODES[mode]) for schema, mode in cases]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(cases))], params)
    for (schema, _), out in zip(cases, outputs):
        _assert_valid(out, SCHEMAS[schema])


def test_regex_json_object_and_ebnf(llama, make_llm):
    llm = make_llm(llama)
    ebnf = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    outs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(
                max_tokens=40,
                temperature=1.0,
                seed=1,
                grammar=GrammarSpec("regex", r"(ab|cd){2,4}!"),
            ),
            SamplingParams(max_tokens=200, temperature=0, grammar=GrammarSpec("json_object")),
            SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("ebnf", ebnf)),
        ],
    )
    import re

    assert outs[0].finish_reason == "stop" and re.fullmatch(r"(ab|cd){2,4}!", outs[0].text), outs[
        0
    ].text
    if (
        outs[1].finish_reason == "stop"
    ):  # any JSON may run past max_tokens; what is there stays a prefix
        assert isinstance(json.loads(outs[1].text), dict)
    assert outs[1].text.startswith("{")
    assert outs[2].finish_reason == "stop" and re.fullmatch(r"\([0-9](,[0-9])*\)", outs[2].text), (
        outs[2].text
    )


def test_unconstrained_requests_in_the_batch_equal_transformers(
    llama, make_llm, hf_greedy, random_prompts
):
    llm = make_llm(
        llama, chunked_prefill_size=24
    )  # chunked prefill of long prompts beside grammar rows
    prompts = random_prompts(6, 5, 60, seed=11)
    plain = SamplingParams(max_tokens=16, temperature=0)
    params = [plain if i % 2 else _schema_params("nested") for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if i % 2:
            assert out.token_ids == hf_greedy(llama, prompt, 16)
        else:
            _assert_valid(out, SCHEMAS["nested"])


def test_overlap_launches_before_the_mask_is_known_and_matches_no_overlap(llama, make_llm):
    """With overlap, step N+1 is launched before step N's token (which decides its mask) is
    known: the mask must be filled after, from the advanced matcher, giving the same tokens as
    without overlap."""
    params = [_schema_params(name, temperature=0) for name in SCHEMAS]
    results, ready_at_launch = {}, []
    for overlap in (True, False):
        llm = make_llm(llama, disable_overlap_schedule=not overlap)
        executor = llm.engine.executor
        launch = executor.launch

        def spy(batch, launch=launch, overlap=overlap):
            if batch.sampling.vocab_mask is not None and overlap:
                ready_at_launch.append(batch.sampling.vocab_mask.is_ready)
            return launch(batch)

        executor.launch = spy
        results[overlap] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert results[True] == results[False]
    assert ready_at_launch.count(False) > 10  # steps really overlapped their mask's fill


def test_shared_prefix_and_cached_grammar(llama, make_llm):
    llm = make_llm(llama)
    grammars = llm.engine.scheduler.grammars
    before = grammars.take_stats()
    prompt = "the same long prefix " * 8
    first = llm.generate([prompt], _schema_params("enum", temperature=0))[0]
    again = llm.generate([prompt, prompt], _schema_params("enum", temperature=0))
    assert [o.token_ids for o in again] == [first.token_ids] * 2
    assert again[1].cached_tokens > 0  # the radix cache served the prompt
    stats = grammars.take_stats()
    assert (
        stats.cache_misses - before.cache_misses == 1 and stats.cache_hits - before.cache_hits == 2
    )
    assert len(stats.compile_seconds) == 1


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (GrammarSpec("json_schema", "{not json"), "JSON schema cannot be compiled: Check failed"),
        # an error within an error: xgrammar writes a timestamp and source file before each
        (GrammarSpec("json_schema", "[" * 20000 + "]" * 20000), "Maximum recursion depth"),
        (GrammarSpec("regex", "(ab", param="regex"), "parenthesis"),
        (GrammarSpec("ebnf", "root ::= foo", param="ebnf"), "foo"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_problem(llama, make_llm, spec, words):
    llm = make_llm(llama)
    out = llm.generate(
        ["hi", "ok"],
        [SamplingParams(max_tokens=4, grammar=spec), SamplingParams(max_tokens=4, ignore_eos=True)],
    )
    message = out[0].finish_message
    assert out[0].finish_reason == "error" and message.startswith(f"{spec.param}: ")
    assert words in message and "cannot be compiled" in message
    assert not re.search(r"\[[\d:]+\] |/project/cpp", message), message
    assert len(message) < 500  # not the schema again, which the client has: 40,000 characters
    assert out[1].finish_reason == "length"  # the other request is unharmed


def test_a_schema_quoted_in_the_error_costs_the_scheduler_no_time_and_the_400_no_length(
    llama, make_llm
):
    """xgrammar quotes the client's text in its error: a regex over it took 2-4 s for a run of
    40,000 spaces, the scheduler's loop stopped for every request; the 400 sent it all back."""
    llm = make_llm(llama)
    schema = '{"type": "nonsense' + " " * 40_000 + 'x"}'
    params = SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", schema))
    start = time.perf_counter()
    [out] = llm.generate(["hi"], params)
    elapsed = time.perf_counter() - start
    assert out.finish_reason == "error" and 'Unsupported type "nonsense' in out.finish_message
    assert out.finish_message.endswith("...") and len(out.finish_message) < 400
    assert elapsed < 1.0, f"{elapsed:.2f} s"


def test_bounded_strings_hold_no_raw_control_characters(llama, make_llm):
    """xgrammar's rule for a string with maxLength let raw control characters in (5 of 30
    seeded answers in a trial), which strict JSON, and the OpenAI SDK's parse(), refuse."""
    schema = {
        "type": "object",
        "required": ["name", "nick", "ok"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "nick": {"type": ["string", "null"], "maxLength": 3},
            "ok": {"type": "boolean"},
        },
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    params = [SamplingParams(max_tokens=60, seed=seed, grammar=spec) for seed in range(40)]
    for out in make_llm(llama).generate(["x"] * len(params), params):
        _assert_valid(out, schema)
        assert 1 <= len(json.loads(out.text)["name"]) <= 6


def test_xgrammar_writes_the_string_classes_the_engine_swaps():
    """The swap is textual: should an xgrammar release write other classes, this fails
    instead of the fix silently doing nothing."""
    import xgrammar

    from kubesgl.engine.scheduler.grammar import _XGRAMMAR_STRING_CHARACTERS, json_grammar

    schema = {
        "type": "object",
        "properties": {"bounded": {"type": "string", "maxLength": 3}, "free": {"type": "string"}},
    }
    plain = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    assert all(character in plain for character in _XGRAMMAR_STRING_CHARACTERS)
    assert not any(c in json_grammar(json.dumps(schema)) for c in _XGRAMMAR_STRING_CHARACTERS)


def test_a_long_bounded_string_compiles_at_once(llama, make_llm):
    """The bounds stay xgrammar's own repetition: written as a regex instead, maxLength 4000
    took 6 s to compile."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}}}
    llm = make_llm(llama)
    started = time.perf_counter()
    (out,) = llm.generate(
        ["x"], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    )
    assert out.finish_reason in ("stop", "length")
    assert time.perf_counter() - started < 3.0


def test_a_cached_compile_error_names_each_requests_own_field(llama, make_llm):
    """One grammar, given in two fields: its compile error is cached, and each request's
    400 names the field it came in (the second named the first's)."""
    llm = make_llm(llama)
    params = [
        SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(ab", param=field))
        for field in ("regex", "sampling_params.regex")
    ]
    for param in params:
        (out,) = llm.generate(["hi"], [param])
        assert out.finish_reason == "error"
        assert out.finish_message.startswith(
            f"{param.grammar.param}: the regular expression cannot"
        )


def test_unknown_kind_is_refused(llama, make_llm):
    llm = make_llm(llama)
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        llm.generate(["hi"], SamplingParams(grammar=GrammarSpec("yaml", "x")))


def test_compiling_does_not_hold_other_requests(llama, make_llm):
    """A request whose grammar is still compiling waits aside, counted as waiting; the others
    step on."""
    from concurrent.futures import Future

    from kubesgl.engine.messages import GenerateRequest

    llm = make_llm(llama)
    scheduler = llm.engine.scheduler
    blocked: Future = Future()
    compile_ = scheduler.grammars.compile
    scheduler.grammars.compile = lambda spec: blocked
    scheduler.add_request(GenerateRequest("g", [5, 6, 7], _schema_params("enum", temperature=0)))
    scheduler.add_request(
        GenerateRequest("p", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    )
    finished = set()
    for _ in range(10):
        finished |= {o.rid for o in scheduler.step() if o.finished}
    assert finished == {"p"} and scheduler.requests["g"] in scheduler.compiling
    assert scheduler.stats().num_waiting == 1  # the load the router and the autoscaler see
    scheduler.add_request(GenerateRequest("aborted", [5, 6], _schema_params("enum", temperature=0)))
    (out,) = scheduler.abort_request(
        "aborted"
    )  # while its grammar compiles: ends at once, nothing held
    assert out.finish_reason.kind == "abort" and [r.rid for r in scheduler.compiling] == ["g"]
    scheduler.grammars.compile = compile_
    blocked.set_result(compile_(GrammarSpec("json_schema", json.dumps(SCHEMAS["enum"]))).result())
    while scheduler.has_work():
        finished |= {o.rid for o in scheduler.step() if o.finished}
    assert finished == {"p", "g"}


def test_grammar_metrics_count_compiles_and_cache_lookups():
    from prometheus_client import generate_latest

    from kubesgl.engine.messages import GrammarStats, SchedulerStats
    from kubesgl.engine.metrics import EngineMetrics

    metrics = EngineMetrics("mixed")
    text = generate_latest(metrics.registry).decode()
    for result in ("hit", "miss"):
        assert f'kubesgl_grammar_cache_total{{result="{result}",role="mixed"}} 0.0' in text
    metrics.update_scheduler(SchedulerStats(0, 0, 0, 1, 0, 0, grammar=GrammarStats(2, 1, [0.004])))
    metrics.update_scheduler(SchedulerStats(0, 0, 0, 1, 0, 0, grammar=GrammarStats(5, 2, [0.2])))
    text = generate_latest(metrics.registry).decode()
    assert 'kubesgl_grammar_cache_total{result="hit",role="mixed"} 5.0' in text
    assert 'kubesgl_grammar_cache_total{result="miss",role="mixed"} 2.0' in text
    assert 'kubesgl_grammar_compile_seconds_count{role="mixed"} 2.0' in text
    assert 'kubesgl_grammar_compile_seconds_bucket{le="0.005",role="mixed"} 1.0' in text


@pytest.mark.parametrize("mixed", [False, True], ids=["", "mixed-chunk"])
def test_answers_validate_and_match_under_retraction_and_mixed_chunks(llama, make_llm, mixed):
    """Grammar requests retracted again and again on a tiny pool (their matchers keep the tokens
    accepted so far while they wait), with prompt chunks and decodes sharing steps or not: each
    answer validates and equals the answer of a large pool."""
    from kubesgl.engine.scheduler.admission import OutputEstimate

    cases = [(schema, mode) for schema in SCHEMAS for mode in ("greedy", "temperature")]
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(len(cases))]
    params = [_schema_params(schema, max_tokens=60, **MODES[mode]) for schema, mode in cases]
    reference = make_llm(llama).generate(prompts, params)
    llm = make_llm(
        llama,
        max_total_tokens=96,
        enable_mixed_chunk=mixed,
        chunked_prefill_size=24 if mixed else 8192,
        max_running_requests=16,
    )
    llm.engine.scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.stats().retractions > 0
    for (schema, _), out, ref in zip(cases, outputs, reference):
        _assert_valid(out, SCHEMAS[schema])
        assert out.token_ids == ref.token_ids
