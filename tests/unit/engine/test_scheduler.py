"""Scheduler behaviour: exact token counts, finishing, abort, and the overlap pitfalls.

Each overlap test names the bug it pins; each fails when the corresponding rule in
scheduler.py is taken out.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.scheduler.admission import OutputEstimate


def run_to_end(engine, max_steps: int = 10_000):
    """Step until idle; returns every output, per request id, in order."""
    outputs = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs[out.rid].append(out)
    raise AssertionError("the scheduler did not become idle")


def submit(engine, rid, prompt, **params):
    engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, params=SamplingParams(**params)))


def assert_well_formed(outputs_by_rid):
    """Exactly one final output per request, and nothing after it."""
    for rid, outs in outputs_by_rid.items():
        finished = [i for i, o in enumerate(outs) if o.finished]
        assert finished == [len(outs) - 1], f"{rid}: finished outputs at {finished} of {len(outs)}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_64_concurrent_requests_return_exactly_max_tokens(
    overlap, page_size, tiny_model, make_llm, random_prompts
):
    llm = make_llm(
        tiny_model("llama"),
        page_size=page_size,
        disable_overlap_schedule=not overlap,
        max_running_requests=64,
        max_total_tokens=64 * 400,
    )
    prompts = random_prompts(64, 1, 40, seed=10)
    counts = [1 + (i * 199) // 63 for i in range(64)]  # 1 .. 200
    params = [
        SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True)
        for i, n in enumerate(counts)
    ]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == counts
    assert all(o.finish_reason == "length" for o in outputs)


def test_one_step_per_token_and_no_reply_after_finish(tiny_model, make_llm, random_prompts):
    """Overlap pitfall: the step launched before a stop token is seen computes one more
    token; no reply may be sent for it."""
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    prompts = random_prompts(8, 5, 30, seed=11)
    reference = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for i, (prompt, ref) in enumerate(zip(prompts, reference)):
        stop_at = 3 + i  # stop on the token greedy decoding produces at this index
        stop_token = ref.token_ids[stop_at]
        submit(
            engine,
            f"r{i}",
            prompt,
            max_tokens=30,
            temperature=0,
            ignore_eos=True,
            stop_token_ids=[stop_token],
        )
    outputs = run_to_end(engine)
    assert_well_formed(outputs)
    for i, ref in enumerate(reference):
        tokens = [t for o in outputs[f"r{i}"] for t in o.token_ids]
        expected = ref.token_ids[: ref.token_ids.index(ref.token_ids[3 + i]) + 1]
        assert tokens == expected
        assert outputs[f"r{i}"][-1].finish_reason.kind == "stop"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_min_tokens_holds_back_every_end(tiny_model, make_llm, random_prompts, overlap):
    """vLLM's min_tokens: the tokens that would end a request (its stop tokens, EOS) are not
    sampled before it has that many."""
    llm = make_llm(tiny_model("llama"), disable_overlap_schedule=not overlap)
    prompts = random_prompts(4, 5, 30, seed=12)
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    reference = llm.generate(prompts, SamplingParams(**greedy))
    stops = [ref.token_ids[1] for ref in reference]  # greedy ends at its second token
    ended = llm.generate(prompts, [SamplingParams(**greedy, stop_token_ids=[t]) for t in stops])
    assert [len(o.token_ids) for o in ended] == [2] * len(prompts)
    held = llm.generate(
        prompts, [SamplingParams(**greedy, stop_token_ids=[t], min_tokens=6) for t in stops]
    )
    for out, stop in zip(held, stops):
        assert len(out.token_ids) >= 6 and stop not in out.token_ids[:6], out.token_ids
        assert stop not in out.token_ids[6:-1]  # after min_tokens, the stop token ends it
    eos = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, min_tokens=12))
    assert all(len(o.token_ids) == 12 for o in eos)  # EOS held back to the end
    # a stop string met within the first tokens does not count, nor cut the text there
    ref = reference[0]
    early = llm.tokenizer.decode(ref.token_ids[:5])
    stop = next(c for c in early if not c.isspace())
    (late,) = llm.generate([prompts[0]], SamplingParams(**greedy, stop=[stop], min_tokens=6))
    assert len(late.token_ids) >= 6 and late.token_ids == ref.token_ids[: len(late.token_ids)]
    assert ref.text.startswith(late.text) and len(late.text) >= len(early)


def test_min_tokens_beyond_what_a_request_may_generate_is_refused(tiny_model, make_llm):
    """With max_tokens unset, the limit is the default or what the context leaves: a
    min_tokens above it could never be met."""
    llm = make_llm(tiny_model("llama"), default_max_tokens=32)
    with pytest.raises(InvalidRequestError, match="exceeds the 32 tokens") as caught:
        submit(llm.engine, "far", [5, 6, 7], max_tokens=None, min_tokens=40)
    assert caught.value.param == "min_tokens"


def test_min_tokens_with_every_token_an_end_is_refused(tiny_model, make_llm):
    """Before min_tokens no token that ends the request may be sampled: if its stop tokens,
    with EOS, are the whole vocabulary, none is left (it ended after one token)."""
    llm = make_llm(tiny_model("llama"))
    engine, scheduler = llm.engine, llm.engine.scheduler
    eos, vocab = scheduler.eos_token_ids, scheduler.limits.vocab_size
    rest = [t for t in range(vocab) if t not in eos]
    with pytest.raises(InvalidRequestError, match="whole vocabulary") as caught:
        submit(engine, "all", [5, 6, 7], max_tokens=4, min_tokens=2, stop_token_ids=rest)
    assert caught.value.param == "stop_token_ids" and caught.value.status == 400
    # ignoring EOS leaves it to sample, as one token short of the vocabulary does
    submit(
        engine, "eos", [5, 6, 7], max_tokens=4, min_tokens=2, stop_token_ids=rest, ignore_eos=True
    )
    submit(engine, "one", [5, 6, 7], max_tokens=4, min_tokens=2, stop_token_ids=rest[1:])
    submit(engine, "none", [5, 6, 7], max_tokens=4, stop_token_ids=rest)  # no min_tokens
    assert_well_formed(run_to_end(engine))


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize(
    "device,backend", [("cpu", "torch"), pytest.param("cuda", "triton", marks=pytest.mark.gpu)]
)
def test_finished_request_resources_not_reused_while_in_flight(
    radix, device, backend, tiny_model, make_llm, random_prompts
):
    """Overlap pitfall: a request that finishes on step N is still part of step N+1, which
    is running; its table row and KV pages must not go to a request of step N+2 before
    step N+1 completes. On the GPU the steps run asynchronously for real (CUDA graphs)."""
    llm = make_llm(
        tiny_model("llama"),
        max_running_requests=4,
        disable_radix_cache=not radix,
        max_total_tokens=4096,
        device=device,
        attention_backend=backend,
    )
    engine = llm.engine
    builder = engine.scheduler.builder
    launched = []  # per built batch: {row: rid}, {slot: rid}; the newest is in flight
    original_build = builder._build

    def checked_build(*args):
        batch = original_build(*args)
        rows = {req.row: req.rid for req in batch.reqs}
        slots = {slot: req.rid for req in batch.reqs for slot in req.slots[: req.num_scheduled]}
        if launched and not engine.scheduler._completed_step >= launched[-1][0]:
            _, in_flight_rows, in_flight_slots = launched[-1]
            for row, rid in rows.items():
                assert in_flight_rows.get(row, rid) == rid, f"row {row} reused while step in flight"
            for slot, rid in slots.items():
                assert in_flight_slots.get(slot, rid) == rid, (
                    f"KV slot {slot} reused while step in flight"
                )
        launched.append((batch.step, rows, slots))
        return batch

    builder._build = checked_build
    prompts = random_prompts(24, 5, 20, seed=12)
    reference = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    launched.clear()
    for i, (prompt, ref) in enumerate(zip(prompts, reference)):
        submit(
            engine,
            f"r{i}",
            prompt,
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            stop_token_ids=[ref.token_ids[1 + i % 5]],
        )
    assert_well_formed(run_to_end(engine))
    assert len(launched) > 10


@pytest.mark.parametrize("chunk", [0, 16], ids=["whole-prompt", "chunked"])
def test_abort_during_in_flight_prefill_releases_once(chunk, tiny_model, make_llm, random_prompts):
    """Overlap pitfall: an abort while the request's prefill is running, then that
    prefill's result: the request must be released exactly once."""
    llm = make_llm(tiny_model("llama"), chunked_prefill_size=chunk)
    engine = llm.engine
    prompt = random_prompts(1, 60, 60, seed=13)[0]
    submit(engine, "victim", prompt, max_tokens=20)
    submit(engine, "bystander", prompt[:30], max_tokens=20, temperature=0, ignore_eos=True)
    assert engine.step() == []  # prefill launched, in flight
    (aborted,) = engine.abort_request("victim", "client went away")
    assert (
        aborted.finish_reason.kind == "abort"
        and aborted.finish_reason.message == "client went away"
    )
    engine.scheduler.check_integrity()
    outputs = run_to_end(engine)
    assert "victim" not in outputs  # nothing more after the abort
    assert len([t for o in outputs["bystander"] for t in o.token_ids]) == 20
    assert_well_formed(outputs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_abort_waiting_prefilling_and_running(overlap, tiny_model, make_llm, random_prompts):
    llm = make_llm(
        tiny_model("qwen3"),
        max_running_requests=2,
        chunked_prefill_size=8,
        disable_overlap_schedule=not overlap,
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    outputs = defaultdict(list)

    def steps(n):
        for _ in range(n):
            for out in engine.step():
                outputs[out.rid].append(out)

    for i, p in enumerate(random_prompts(4, 40, 40, seed=14)):
        submit(engine, f"r{i}", p, max_tokens=50, ignore_eos=True)
    steps(3)
    assert scheduler.requests["r0"].status.name == "PREFILLING"
    assert scheduler.requests["r3"].status.name == "WAITING"
    for out in engine.abort_request("r3") + engine.abort_request("r0"):
        outputs[out.rid].append(out)
    scheduler.check_integrity()
    steps(12)
    assert scheduler.requests["r1"].status.name == "DECODING"
    for out in engine.abort_request("r1"):
        outputs[out.rid].append(out)
    assert engine.abort_request("r1") == [] and engine.abort_request("unknown") == []
    while engine.has_work():
        steps(1)
    assert_well_formed(outputs)
    assert [outputs[r][-1].finish_reason.kind for r in ("r0", "r1", "r2", "r3")] == [
        "abort",
        "abort",
        "length",
        "abort",
    ]
    assert sum(len(o.token_ids) for o in outputs["r2"]) == 50
    assert sum(len(o.token_ids) for o in outputs["r0"] + outputs["r3"]) == 0


def test_eos_from_generation_config_ends_a_request_unless_ignored(
    tmp_path, tiny_model, make_llm, random_prompts
):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), path)
    prompt = random_prompts(1, 10, 10, seed=15)[0]
    greedy = make_llm(str(path)).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    eos = greedy[0].token_ids[4]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = make_llm(str(path))
    stopped, ignored, also_listed, listed_only = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(max_tokens=20, temperature=0),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[eos]),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[eos]),
        ],
    )
    first_eos = greedy[0].token_ids.index(eos)
    assert stopped.token_ids == greedy[0].token_ids[: first_eos + 1]
    # EOS, the model's own ending, names no stop_reason (as vLLM's): only a stop string or a
    # stop_token_ids entry does; an EOS listed in stop_token_ids too is EOS first, as in vLLM,
    # unless EOS is ignored
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == greedy[0].token_ids and ignored.finish_reason == "length"
    assert also_listed.token_ids == stopped.token_ids and also_listed.stop_reason is None
    assert listed_only.token_ids == stopped.token_ids and listed_only.stop_reason == eos


def test_bad_requests_raise_and_others_go_on(tiny_model, make_llm, random_prompts):
    llm = make_llm(tiny_model("llama"), context_length=128, max_total_tokens=1024)
    engine = llm.engine
    good = random_prompts(2, 10, 20, seed=16)
    submit(engine, "good0", good[0], max_tokens=10, ignore_eos=True)
    cases = [
        ([1] * 128, {"max_tokens": 1}, "prompt", "context length is 128"),
        ([1] * 100, {"max_tokens": 40}, "max_tokens", "lower max_tokens to at most 28"),
        ([1] * 10, {"max_tokens": 0}, "max_tokens", "must be at least 1"),
        ([], {"max_tokens": 4}, "prompt", "empty"),
        ([10**6], {"max_tokens": 4}, "prompt", "outside the vocabulary"),
        ([1] * 10, {"top_p": 0.0}, "top_p", "top_p"),
        ([1] * 10, {"temperature": -1.0}, "temperature", "temperature"),
        ([1] * 10, {"stop_token_ids": [-5]}, "stop_token_ids", "outside the vocabulary"),
    ]
    for i, (prompt, params, param, message) in enumerate(cases):
        with pytest.raises(InvalidRequestError, match=message) as err:
            submit(engine, f"bad{i}", prompt, **params)
        assert err.value.param == param
    submit(engine, "good1", good[1], max_tokens=10, ignore_eos=True)
    outputs = run_to_end(engine)
    assert sorted(outputs) == ["good0", "good1"]
    assert all(sum(len(o.token_ids) for o in outs) == 10 for outs in outputs.values())


def test_request_larger_than_the_pool_is_rejected_naming_what_to_lower(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), max_total_tokens=64)
    with pytest.raises(InvalidRequestError, match="pool holds 64.*at most 25") as too_long:
        llm.generate([[5] * 40], SamplingParams(max_tokens=40))
    assert too_long.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="prompt .80 tokens.*pool holds 64") as prompt:
        llm.generate([[5] * 80], SamplingParams(max_tokens=1))
    assert prompt.value.param == "prompt"  # no max_tokens would do


def test_a_pool_shorter_than_the_context_is_warned_of_at_start(tiny_model, make_llm, caplog):
    """--max-total-tokens 16 on a 2048-context model started without a word and then refused
    every longer request; the warning's longest request is the one that fits."""
    with caplog.at_level(logging.WARNING, logger="kubesgl.engine.scheduler.engine"):
        llm = make_llm(tiny_model("llama"), max_total_tokens=64)
    assert caplog.messages == [
        "the KV pool holds 64 tokens, fewer than the context length (2048): the longest request "
        "(prompt and max_tokens together) that fits is 65 tokens, and longer ones are refused; "
        "to serve the whole context, give --max-total-tokens of at least 2048, or lower "
        "--context-length to 65"
    ]
    llm.generate([[5] * 40], SamplingParams(max_tokens=25))
    with pytest.raises(InvalidRequestError, match="pool holds 64"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=26))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubesgl.engine.scheduler.engine"):
        make_llm(tiny_model("llama"), max_total_tokens=64, context_length=65)
    assert caplog.messages == []


def test_unsupported_architecture_is_named(tmp_path, tiny_model):
    import json
    import shutil

    from kubesgl.engine import LLM
    from kubesgl.engine.model_config import ModelConfigError

    path = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path), device="cpu")


def test_admission_on_estimate_runs_more_without_over_committing(
    tiny_model, make_llm, random_prompts
):
    """A pool that fits two requests' full reservations runs more at once (admission reserves
    the outputs it expects, not max_tokens), never commits more KV than it has, and every
    request still returns all of its tokens."""
    llm = make_llm(tiny_model("llama"), max_total_tokens=2 * 60, disable_radix_cache=True)
    engine = llm.engine
    for i, p in enumerate(random_prompts(5, 20, 20, seed=17)):
        submit(engine, f"r{i}", p, max_tokens=41, ignore_eos=True)  # 60 KV tokens each
    peak = 0
    outputs = defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            outputs[out.rid].append(out)
        stats = engine.scheduler.stats()
        peak = max(peak, stats.num_running)
        assert stats.kv_used_tokens <= stats.kv_total_tokens
    assert peak > 2
    assert all(sum(len(o.token_ids) for o in outs) == 41 for outs in outputs.values())


def test_aborting_retracted_requests_leaves_nothing_behind(tiny_model, make_llm, random_prompts):
    """A retracted request waits with its outputs and no KV: an abort then ends it at once with
    the tokens it had, and the others still finish."""
    llm = make_llm(tiny_model("llama"), max_total_tokens=96)
    engine = llm.engine
    engine.scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
    for i, prompt in enumerate(random_prompts(8, 10, 20, seed=23)):
        submit(engine, f"r{i}", prompt, max_tokens=40, temperature=0, ignore_eos=True)
    outputs = defaultdict(list)
    aborted = set()
    while engine.has_work():
        for out in engine.step():
            outputs[out.rid].append(out)
        for req in list(engine.scheduler.waiting):
            if req.retractions and req.rid not in aborted:
                aborted.add(req.rid)
                final = engine.abort_request(req.rid)
                assert (
                    final[0].finish_reason.kind == "abort"
                    and final[0].completion_tokens == len(req.output_ids) > 0
                )
                outputs[req.rid] += final
        engine.scheduler.check_integrity()
    assert aborted
    assert_well_formed(outputs)
    for rid, outs in outputs.items():
        if rid not in aborted:
            assert sum(len(o.token_ids) for o in outs) == 40


def test_output_estimate_follows_finished_requests_and_backs_off_on_retraction():
    estimate = OutputEstimate(ratio=0.5)
    assert estimate.outputs(100) == 50 and estimate.outputs(1) == 1 and estimate.outputs(0) == 1
    for _ in range(100):
        estimate.finished(10, 4096)  # short answers to requests that set no max_tokens
    assert estimate.ratio == estimate.floor
    estimate.retracted()
    assert estimate.ratio == estimate.floor * estimate.backoff
    for _ in range(100):
        estimate.finished(200, 200)  # every request runs to max_tokens: reserve all of it again
    assert estimate.outputs(100) == 100


def test_requests_allowed_one_token_teach_the_estimate_nothing():
    """/health_generate's probe (max_tokens 1), every few seconds: its one token is forced, so
    it would drag the ratio toward reserving all of max_tokens for everyone else."""
    estimate = OutputEstimate(ratio=0.2)
    for _ in range(50):
        estimate.finished(1, 1)
    assert estimate.ratio == 0.2


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_retraction_storm_finishes_every_request_exactly(
    overlap, radix, page_size, tiny_model, make_llm, random_prompts
):
    """24 requests on a pool that holds about one and a half of them whole: requests are
    retracted again and again, yet each returns exactly what it returns on a large pool
    (greedy, seeded sampling, penalties alike), and the pages stay accounted for at every step."""
    run_retraction_storm(
        tiny_model,
        make_llm,
        random_prompts,
        page_size,
        disable_radix_cache=not radix,
        disable_overlap_schedule=not overlap,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_storm_with_mixed_chunks(page_size, tiny_model, make_llm, random_prompts):
    """The storm with prompt chunks and decodes sharing steps: the decodes of a mixed step keep
    the pages they need although the step also admits requests (the admissions come after)."""
    run_retraction_storm(
        tiny_model,
        make_llm,
        random_prompts,
        page_size,
        enable_mixed_chunk=True,
        chunked_prefill_size=24,
        max_running_requests=16,
    )


def run_retraction_storm(
    tiny_model, make_llm, random_prompts, page_size: int, **engine_args
) -> None:
    path = tiny_model("llama")
    prompts = random_prompts(24, 10, 40, seed=21)
    kinds = [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 7},
        {
            "temperature": 0,
            "repetition_penalty": 1.3,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.2,
        },
    ]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, **kinds[i % 3]) for i in range(24)]
    reference = make_llm(path, page_size=page_size).generate(prompts, params)
    llm = make_llm(path, page_size=page_size, max_total_tokens=128, **engine_args)
    engine = llm.engine
    # An estimate that stays at its most optimistic (5 % of max_tokens) whatever happens
    engine.scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(GenerateRequest(rid=f"r{i}", input_ids=prompt, params=p))
    outputs = defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            outputs[out.rid].append(out)
        engine.scheduler.check_integrity()
    assert_well_formed(outputs)
    got = [[t for o in outputs[f"r{i}"] for t in o.token_ids] for i in range(24)]
    assert got == [r.token_ids for r in reference]
    assert engine.scheduler.stats().retractions >= 20


def test_offline_text_stops_before_the_stop_string(tiny_model, make_llm):
    """LLM.generate cuts its text where the server's stream would: before the stop string."""
    llm = make_llm(tiny_model("llama"))
    prompt = "The capital of France is"
    full = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ].text
    stop = full[12:15]
    got = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == full[: full.index(stop)]
    ids = llm.tokenizer.encode(prompt)
    assert llm.generate([ids], SamplingParams(max_tokens=5, temperature=0))[
        0
    ].text  # token-id prompts get text too


def test_unset_max_tokens_defaults_and_usage_counts_reservations(tiny_model, make_llm):
    """A request without max_tokens gets --default-max-tokens (not the whole context, which
    admission would reserve), and KV usage counts what admission reserved."""
    llm = make_llm(
        tiny_model("llama"), default_max_tokens=8, max_total_tokens=4096, disable_radix_cache=True
    )
    out = llm.generate([[5] * 20], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    engine = llm.engine
    submit(engine, "r", [5] * 20, max_tokens=41, ignore_eos=True)
    engine.step()  # admitted and prefilled
    expected = engine.scheduler.kv.estimate.outputs(41)
    assert (
        engine.scheduler.stats().kv_used_tokens == 20 + expected - 1
    )  # held now plus reserved for later
    run_to_end(engine)
    assert engine.scheduler.stats().kv_used_tokens == 0


def test_queue_and_prefill_seconds_come_with_the_first_output_only(
    tiny_model, make_llm, random_prompts
):
    """Issue 15: the scheduler's times behind kubesgl_request_queue_time_seconds and
    kubesgl_request_prefill_time_seconds; a request that waits behind a full batch shows it."""
    llm = make_llm(tiny_model("llama"), max_running_requests=1)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(2, 5, 20, seed=12)):
        submit(engine, f"r{i}", prompt, max_tokens=4, temperature=0, ignore_eos=True)
    outputs = run_to_end(engine)
    for rid in ("r0", "r1"):
        timed = [o for o in outputs[rid] if o.queue_seconds is not None]
        assert timed == [outputs[rid][0]] and timed[0].prefill_seconds >= 0
    # r1 waited while r0 ran all of its steps
    assert outputs["r1"][0].queue_seconds > outputs["r0"][0].queue_seconds
    assert outputs["r1"][0].queue_seconds >= outputs["r0"][0].prefill_seconds


def test_estimate_backs_off_once_per_shortage_not_per_retracted_request(
    tiny_model, make_llm, random_prompts
):
    """A shortage that retracts several requests at once is one sign that the estimate is short:
    the ratio grows by the backoff once, not once per request, so a burst of retractions cannot
    compound it to whole reservations."""

    class CountingEstimate(OutputEstimate):
        backoffs = 0

        def retracted(self) -> None:
            CountingEstimate.backoffs += 1
            super().retracted()

    llm = make_llm(tiny_model("llama"), page_size=16, max_total_tokens=128)
    engine = llm.engine
    engine.scheduler.kv.estimate = CountingEstimate(ratio=0.05, weight=0.0, backoff=1.01)
    # prompts of one length decode in step: their next pages are all wanted at the same step
    for i, prompt in enumerate(random_prompts(24, 16, 16, seed=21)):
        submit(engine, f"r{i}", prompt, max_tokens=48, temperature=0, ignore_eos=True)
    run_to_end(engine)
    retractions = engine.scheduler.stats().retractions
    assert 0 < CountingEstimate.backoffs < retractions
    assert engine.scheduler.kv.estimate.ratio == pytest.approx(
        0.05 * 1.01**CountingEstimate.backoffs
    )


@pytest.mark.parametrize("mixed", [False, True], ids=["extend-steps", "mixed-steps"])
def test_admission_leaves_a_running_decode_its_next_page(mixed, tiny_model, make_llm):
    """A request that has outgrown its reservation needs an unreserved page at its next decode
    step. Admission must leave it that page: a newcomer that takes it is prefilled, then
    retracted at once to make room, its whole prefill wasted (the bug: only mixed steps
    reserved the decodes' pages before admitting)."""
    llm = make_llm(
        tiny_model("llama"),
        max_total_tokens=64,
        chunked_prefill_size=32,
        max_running_requests=4,
        enable_mixed_chunk=mixed,
        disable_overlap_schedule=True,
    )
    engine = llm.engine
    scheduler = engine.scheduler
    scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
    submit(engine, "long", list(range(10, 18)), max_tokens=50, temperature=0, ignore_eos=True)
    outputs = defaultdict(list)
    for _ in range(31):
        for out in engine.step():
            outputs[out.rid].append(out)
    long = scheduler.requests["long"]
    assert long.reserved_pages == 0  # past its estimate: every next token takes a free page
    # a prompt of all the pages nobody holds or reserved: it fits only by taking the decode's
    submit(
        engine,
        "newcomer",
        list(range(100, 100 + scheduler.kv.available_pages())),
        max_tokens=2,
        temperature=0,
        ignore_eos=True,
    )
    for rid, outs in run_to_end(engine).items():
        outputs[rid] += outs
    assert scheduler.stats().retractions == 0
    assert [sum(len(o.token_ids) for o in outputs[r]) for r in ("long", "newcomer")] == [50, 2]
    scheduler.check_integrity()
