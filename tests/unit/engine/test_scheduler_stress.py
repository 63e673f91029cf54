"""A seeded random workload through the scheduler's features at once: requests arriving between
steps, n copies of a prompt behind their first (prefix_leader), stop tokens, min_tokens, seeded
sampling, aborts of waiting, decoding and retracted requests (prefilling ones where the draws
fall so), a queue limit, and a pool so small, under an output estimate kept low, that running
requests are retracted again and again. After every step the pages add up; at the end every request ended exactly once, and
each that ran to its own end returned what it returns alone on a large pool (an aborted one: a
prefix of that)."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest
from test_scheduler import assert_well_formed

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.scheduler.request import ReqStatus

CONFIGS = {
    "page1-overlap-fcfs-chunked": dict(
        page_size=1, chunked_prefill_size=16, max_running_requests=6, max_total_tokens=64
    ),
    "page16-lpm-mixed": dict(
        page_size=16,
        disable_overlap_schedule=True,
        schedule_policy="lpm",
        enable_mixed_chunk=True,
        chunked_prefill_size=24,
        max_running_requests=6,
        max_total_tokens=128,
    ),
    "page16-overlap-dfs-weight": dict(
        page_size=16,
        schedule_policy="dfs-weight",
        max_running_requests=4,
        max_total_tokens=96,
    ),
    "page1-overlap-lpm-mixed-unchunked": dict(
        page_size=1,
        schedule_policy="lpm",
        enable_mixed_chunk=True,
        chunked_prefill_size=0,
        max_running_requests=8,
        max_total_tokens=80,
    ),
}


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_random_workload_ends_every_request_exactly(config, tiny_model, make_llm):
    rng = random.Random(config)
    path = tiny_model("llama")
    llm = make_llm(path, **CONFIGS[config])
    engine, scheduler = llm.engine, llm.engine.scheduler
    # a server's --max-queued-requests (the offline LLM takes one request at a time)
    scheduler.limits = dataclasses.replace(scheduler.limits, max_queued_requests=6)
    bases = [[rng.randrange(3, 600) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    taken: dict[str, tuple[list[int], SamplingParams]] = {}
    outputs = defaultdict(list)
    aborted_in: set[str] = set()
    refusals: list[str] = []

    def arrive(group: int) -> None:
        shared = rng.choice(bases)[: rng.randint(1, 30)]  # prefixes in the radix cache
        prompt = shared + [rng.randrange(3, 600) for _ in range(rng.randint(0, 6))]
        options: dict = dict(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0)
        if rng.random() < 0.3:
            options.update(stop_token_ids=[rng.randrange(3, 600) for _ in range(30)])
            options.update(min_tokens=rng.randint(0, options["max_tokens"]))
        if rng.random() < 0.3:
            options.update(temperature=0.9, seed=rng.randrange(1000))
        params = SamplingParams(**options)
        first = f"g{group}-0"
        for i in range(rng.choice([1, 1, 2, 3])):
            rid = f"g{group}-{i}"
            leader = None if i == 0 else first
            try:
                engine.add_request(
                    GenerateRequest(
                        rid, prompt, params, prefix_leader=leader, request_leader=leader
                    )
                )
            except InvalidRequestError as refused:
                assert refused.status == 503 and i == 0  # the queue is full; copies follow
                refusals.append(rid)
                return
            taken[rid] = (prompt, params)

    def abort_one() -> None:
        states = defaultdict(list)
        for rid, req in scheduler.requests.items():
            retracted = req.status is ReqStatus.WAITING and req.retractions
            states["retracted" if retracted else req.status.name].append(rid)
        state = rng.choice(sorted(states))
        aborted_in.add(state)
        for out in engine.abort_request(rng.choice(states[state])):
            outputs[out.rid].append(out)

    for group in range(8):
        arrive(group)
    step = 0
    while engine.has_work() or step < 120:
        step += 1
        assert step < 5000, "the scheduler did not become idle"
        scheduler.kv.estimate.ratio = scheduler.kv.estimate.floor  # admits too much: retractions
        if step < 120 and rng.random() < 0.15:
            arrive(8 + step)
        if scheduler.requests and rng.random() < 0.05:
            abort_one()
        for out in engine.step():
            outputs[out.rid].append(out)
        scheduler.check_integrity()
    assert_well_formed(outputs)
    assert set(outputs) == set(taken)
    # what the workload is for happened: retractions, 503s, copies, aborts of each kind
    assert scheduler.stats().retractions >= 5 and refusals
    assert any(not rid.endswith("-0") for rid in taken)  # copies ran behind their first
    assert {"WAITING", "DECODING", "retracted"} <= aborted_in
    reference = make_llm(path).generate(
        [prompt for prompt, _ in taken.values()], [params for _, params in taken.values()]
    )
    for rid, ref in zip(taken, reference):
        outs = outputs[rid]
        tokens = [t for out in outs for t in out.token_ids]
        if outs[-1].finish_reason.kind == "abort":
            assert tokens == ref.token_ids[: len(tokens)], rid
        else:
            assert (tokens, outs[-1].finish_reason.kind) == (ref.token_ids, ref.finish_reason), rid
