"""The prefill and decode roles of the scheduler, in one process: a prefill engine and a
decode engine on the same tiny model, KV moved over NIXL (UCX on host memory), driven
turn by turn as their scheduler loops would drive them."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import pytest
import zmq

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.protocol import RoomCancelled
from kubesgl.engine.ipc import Endpoints
from kubesgl.engine.messages import BootstrapTarget, GenerateRequest
from kubesgl.engine.sampling_params import GrammarSpec
from kubesgl.engine.scheduler.engine import Engine
from kubesgl.engine.scheduler.process import TRANSFER_POLL_MS, SchedulerLoop

_rooms = itertools.count(1)


@pytest.fixture
def make_engine():
    made = []

    def make(model: str, role: str, **options) -> Engine:
        options = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, **options}
        engine = Engine(
            EngineConfig(model=model, role=role, disaggregation_bootstrap_port=0, **options),
            bootstrap_host="127.0.0.1",
        )
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


def pd_generate(
    prefill: Engine, decode: Engine, prompts, params: SamplingParams, port: int | None = None
):
    port = port or prefill.role.transfers.link.port
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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_output_through_prefill_and_decode_equals_a_mixed_engine(
    arch, page_size, tiny_model, make_engine, random_prompts
):
    model = tiny_model(arch)
    options = {"page_size": page_size, "chunked_prefill_size": 32}
    mixed = make_engine(model, "mixed", **options)
    prefill, decode = (
        make_engine(model, "prefill", **options),
        make_engine(model, "decode", **options),
    )
    prompts = random_prompts(6, 3, 90, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        mixed.add_request(GenerateRequest(f"m{i}", prompt, params))
    reference = run([mixed], finished([f"m{i}" for i in range(len(prompts))]))
    outputs = pd_generate(prefill, decode, prompts, params)
    for i in range(len(prompts)):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
        assert outputs[f"d{i}"][-1].finish_reason.kind == "length"
        assert (
            tokens(outputs, f"p{i}") == tokens(reference, f"m{i}")[:1]
        )  # the prefill answer: the first token
    assert_idle(prefill, decode)


def test_a_decode_engine_with_mixed_chunks_prefills_whole_requests_beside_its_rooms(
    tiny_model, make_engine, random_prompts
):
    """The router sends short prompts to a decode engine whole: with --enable-mixed-chunk (which
    the prefill engine accepts too, one spec.engine serving both pools) their prefill shares
    steps with the rooms that decode there, and every answer equals a mixed engine's."""
    model = tiny_model("llama")
    options = {"chunked_prefill_size": 32, "max_running_requests": 16}
    rooms, wholes = random_prompts(4, 3, 60, seed=40), random_prompts(3, 40, 80, seed=41)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    reference = mixed_reference(model, rooms + wholes, [params] * 7, make_engine, **options)
    prefill = make_engine(model, "prefill", enable_mixed_chunk=True, **options)
    decode = make_engine(model, "decode", enable_mixed_chunk=True, **options)
    modes = []
    launch = decode.executor.launch
    decode.executor.launch = lambda batch: modes.append(batch.mode.name) or launch(batch)
    port = prefill.role.transfers.link.port
    for i, prompt in enumerate(rooms):
        target = BootstrapTarget(next(_rooms), "127.0.0.1", port)
        decode.add_request(GenerateRequest(f"d{i}", prompt, params, bootstrap=target))
        prefill.add_request(GenerateRequest(f"p{i}", prompt, params, bootstrap=target))
    outputs = run(
        [prefill, decode], lambda outs: all(len(outs[f"d{i}"]) > 1 for i in range(len(rooms)))
    )
    for i, prompt in enumerate(wholes):
        decode.add_request(GenerateRequest(f"w{i}", prompt, params))
    rids = [f"d{i}" for i in range(len(rooms))] + [f"w{i}" for i in range(len(wholes))]
    for rid, outs in run([prefill, decode], finished(rids)).items():
        outputs[rid] += outs
    assert "MIXED" in modes
    for i in range(len(rooms)):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
    for i in range(len(wholes)):
        assert tokens(outputs, f"w{i}") == tokens(reference, f"m{len(rooms) + i}"), i
    assert_idle(prefill, decode)


def mixed_reference(model, prompts, params_list, make_engine, **options):
    mixed = make_engine(model, "mixed", **options)
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        mixed.add_request(GenerateRequest(f"m{i}", prompt, params))
    return run([mixed], finished([f"m{i}" for i in range(len(prompts))]))


def test_sampling_options_through_prefill_and_decode_equal_a_mixed_engine(
    tiny_model, make_engine, random_prompts
):
    """The first token is sampled on the prefill engine, the rest on the decode engine: seeds,
    penalties, logprobs, stop strings and the end of generation must count it exactly as a
    mixed engine does."""
    model = tiny_model("llama")
    prompts = random_prompts(6, 4, 40, seed=21)
    reference_greedy = mixed_reference(
        model, prompts[4:5], [SamplingParams(max_tokens=1, temperature=0)], make_engine
    )
    first_token = tokens(reference_greedy, "m0")[0]
    params_list = [
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=24,
            temperature=0.7,
            seed=3,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, logprobs=0),
        SamplingParams(
            max_tokens=30, temperature=0, stop_token_ids=[first_token]
        ),  # the first token ends it
        SamplingParams(max_tokens=30, temperature=0.8, seed=11, stop=["e"], ignore_eos=True),
    ]
    reference = mixed_reference(model, prompts, params_list, make_engine)
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")
    rids = []
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
        decode.add_request(GenerateRequest(f"d{i}", prompt, params, bootstrap=target))
        prefill.add_request(GenerateRequest(f"p{i}", prompt, params, bootstrap=target))
        rids += [f"d{i}", f"p{i}"]
    outputs = run([prefill, decode], finished(rids))
    for i in range(len(prompts)):
        got, want = outputs[f"d{i}"], reference[f"m{i}"]
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
        # every detail (the matched stop string, where it ends), not only the kind
        assert got[-1].finish_reason == want[-1].finish_reason, i
        got_lp = [lp for out in got for lp in out.logprobs or []]
        want_lp = [lp for out in want for lp in out.logprobs or []]
        assert [(lp.token_id, lp.top and [t for t, _ in lp.top]) for lp in got_lp] == [
            (lp.token_id, lp.top and [t for t, _ in lp.top]) for lp in want_lp
        ], i
        assert [lp.logprob for lp in got_lp] == pytest.approx(
            [lp.logprob for lp in want_lp], abs=1e-5
        )
    assert outputs["d4"][-1].finish_reason.kind == "stop" and len(tokens(outputs, "d4")) == 1
    assert_idle(prefill, decode)


def test_n_copies_each_with_its_own_room(tiny_model, make_engine, random_prompts):
    model = tiny_model("llama")
    [prompt] = random_prompts(1, 20, 20, seed=5)
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=40 + i, ignore_eos=True)
        for i in range(3)
    ]
    reference = mixed_reference(model, [prompt] * 3, params, make_engine)
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")
    rids = []
    for i in range(3):
        target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
        decode.add_request(GenerateRequest(f"d{i}", prompt, params[i], bootstrap=target))
        prefill.add_request(
            GenerateRequest(
                f"p{i}", prompt, params[i], bootstrap=target, prefix_leader=None if i == 0 else "p0"
            )
        )
        rids += [f"d{i}", f"p{i}"]
    outputs = run([prefill, decode], finished(rids))
    for i in range(3):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}")
    assert outputs["d2"][-1].cached_tokens == 19  # the prefill engine computed the prompt once
    assert_idle(prefill, decode)


def submit_pair(prefill, decode, rid, prompt, params, port=None):
    target = BootstrapTarget(next(_rooms), "127.0.0.1", port or prefill.role.transfers.link.port)
    decode.add_request(GenerateRequest(f"d{rid}", prompt, params, bootstrap=target))
    prefill.add_request(GenerateRequest(f"p{rid}", prompt, params, bootstrap=target))
    return target


def step_until(engines, condition, timeout: float = 30.0):
    outputs = defaultdict(list)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for engine in engines:
            for out in engine.step():
                outputs[out.rid].append(out)
        time.sleep(0.0005)
    return outputs


@pytest.mark.parametrize("when", ["before the write", "after the write"])
def test_a_decode_request_aborted_while_its_kv_may_come_keeps_its_slots_until_no_write_can(
    when, tiny_model, make_engine, random_prompts
):
    model = tiny_model("llama")
    options = {"max_total_tokens": 160}  # small: the next request reuses the aborted one's slots
    prefill, decode = (
        make_engine(model, "prefill", **options),
        make_engine(model, "decode", **options),
    )
    first, second = random_prompts(2, 60, 60, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    decode.add_request(GenerateRequest("d0", first, params, bootstrap=target))
    server = prefill.role.transfers.link.service.server
    step_until(  # the prefill scheduler connects to the decode engine, then its room is posted
        [prefill, decode],
        lambda: (
            decode.scheduler.requests["d0"].status.name == "AWAITING_KV"
            and bool(server._engines)
            and not server._connecting
        ),
    )
    if (
        when == "after the write"
    ):  # the KV and its notification are on their way when the client leaves
        prefill.add_request(GenerateRequest("p0", first, params, bootstrap=target))
        step_until([prefill], lambda: "p0" not in prefill.scheduler.requests)
    [aborted] = decode.abort_request("d0", "the client disconnected")
    assert aborted.finish_reason.kind == "abort"
    assert decode.scheduler.kv.committed_tokens() >= 60  # the slots are held, not reused yet
    stats = decode.role.stats()
    assert stats.requests_by_state == {"finished": 1}  # and the gauge says so
    assert stats.failures_by_reason == {"aborted": 1}  # kubesgl_disagg_failures_total
    if when == "before the write":  # the cancel is at the prefill engine before its request is
        facts = prefill.role.transfers.link._facts.queue
        step_until([decode], lambda: any(isinstance(fact, RoomCancelled) for fact in facts))
        prefill.add_request(GenerateRequest("p0", first, params, bootstrap=target))
    outputs = step_until(
        [prefill, decode],
        lambda: not decode.scheduler.has_work() and not prefill.scheduler.has_work(),
    )
    if when == "before the write":  # the prefill engine dropped the room instead of prefilling it
        assert (  # aborted, as the decode engine's request was (its client left)
            outputs["p0"][-1].finish_reason.kind == "abort"
            and "cancelled" in outputs["p0"][-1].finish_reason.message
        )
        assert prefill.role.stats().failures_by_reason == {"aborted": 1}
    assert_idle(prefill, decode)
    reference = mixed_reference(model, [second], [params], make_engine, **options)
    outputs = pd_generate(prefill, decode, [second], params)
    assert tokens(outputs, "d0") == tokens(reference, "m0")
    assert_idle(prefill, decode)


def test_a_decode_request_aborted_while_the_prefill_engine_prefills_is_aborted_there_too(
    tiny_model, make_engine, random_prompts
):
    """The decode engine's client leaves while the prefill engine is still prefilling the
    room's prompt, and nothing closes the prefill engine's request (SGLang's router drains
    it; the kubesgl router's close may come later): the decode engine's cancel says its
    request was aborted, and the prefill engine stops and ends its request as an abort,
    counted `aborted` on both engines, not as a failure of its own (a 502, `refused`), as a
    trial's dashboard showed it."""
    model = tiny_model("llama")
    prefill = make_engine(model, "prefill", chunked_prefill_size=4)  # hundreds of steps
    decode = make_engine(model, "decode")
    [prompt] = random_prompts(1, 1000, 1000, seed=5)
    submit_pair(prefill, decode, "0", prompt, SamplingParams(max_tokens=8, temperature=0))
    p0, d0 = prefill.scheduler.requests["p0"], decode.scheduler.requests["d0"]
    step_until(
        [prefill, decode],
        lambda: d0.status.name == "AWAITING_KV" and p0.status.name == "PREFILLING",
    )
    decode.abort_request("d0", "the client disconnected")
    outputs = step_until([prefill, decode], lambda: "p0" not in prefill.scheduler.requests)
    final = outputs["p0"][-1]
    assert final.finished and final.finish_reason.kind == "abort", final.finish_reason
    assert "the client disconnected" in final.finish_reason.message
    assert p0.num_computed < len(prompt) and not final.token_ids  # stopped mid-prompt
    assert prefill.role.stats().failures_by_reason == {"aborted": 1}
    assert decode.role.stats().failures_by_reason == {"aborted": 1}
    step_until(
        [prefill, decode],
        lambda: not decode.scheduler.has_work() and not prefill.scheduler.has_work(),
    )
    assert_idle(prefill, decode)


def test_a_request_the_prefill_engine_refuses_fails_on_the_decode_engine_at_once(
    tiny_model, make_engine, random_prompts
):
    model = tiny_model("llama")
    prefill, decode = make_engine(model, "prefill", context_length=64), make_engine(model, "decode")
    [prompt] = random_prompts(1, 80, 80, seed=2)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    decode.add_request(
        GenerateRequest("d0", prompt, SamplingParams(max_tokens=8), bootstrap=target)
    )
    with pytest.raises(InvalidRequestError, match="context length"):
        prefill.add_request(
            GenerateRequest("p0", prompt, SamplingParams(max_tokens=8), bootstrap=target)
        )
    started = time.monotonic()
    outputs = run([prefill, decode], finished(["d0"]))
    reason = outputs["d0"][-1].finish_reason
    assert reason.kind == "error" and reason.status == 400 and "context length" in reason.message
    assert time.monotonic() - started < 5
    step_until([prefill, decode], lambda: not decode.scheduler.has_work())
    assert_idle(prefill, decode)


@pytest.mark.parametrize("refused_by", ["scheduler", "api_server"])
def test_a_request_the_prefill_engine_refuses_fails_at_once_while_the_decode_engine_queues_it(
    tiny_model, make_engine, random_prompts, refused_by
):
    """The decode engine's batch is full, so it queues the room and posts no slots; the
    prefill engine refuses the request (its context is shorter): its scheduler, or its API
    server before the scheduler sees the request (RoomRefused, which the scheduler process
    hands to the role). The decode engine fails it with the prefill engine's 400, counted
    `refused`, while its batch is still busy: not once it could post the room, when the
    router, which waits 1 s for the decode engine's answer after the prefill engine's
    refusal, would have aborted it (an abort, and a late 400)."""
    model = tiny_model("llama")
    prefill = make_engine(model, "prefill", context_length=64)
    decode = make_engine(model, "decode", max_running_requests=1)
    busy_prompt, prompt = random_prompts(2, 80, 80, seed=2)
    busy = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    decode.add_request(GenerateRequest("local", busy_prompt, busy))
    decode.step()  # admitted: the batch is full
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    decode.add_request(
        GenerateRequest("d0", prompt, SamplingParams(max_tokens=8), bootstrap=target)
    )
    if refused_by == "scheduler":
        with pytest.raises(InvalidRequestError, match="context length"):
            prefill.add_request(
                GenerateRequest("p0", prompt, SamplingParams(max_tokens=8), bootstrap=target)
            )
    else:
        prefill.role.refused(target, "the prompt is 80 tokens long; context length 64", 400)
    outputs = run([prefill, decode], finished(["d0"]))
    reason = outputs["d0"][-1].finish_reason
    assert reason.kind == "error" and reason.status == 400 and "context length" in reason.message
    assert not outputs["local"][-1].finished  # the room was never admitted
    assert decode.role.stats().failures_by_reason == {"refused": 1}
    step_until([prefill, decode], lambda: not decode.scheduler.has_work())
    assert_idle(prefill, decode)


def test_a_request_the_decode_engine_refuses_releases_the_prefill_engine_at_once(
    tiny_model, make_engine, random_prompts
):
    model = tiny_model("llama")
    prefill, decode = (
        make_engine(model, "prefill"),
        make_engine(model, "decode", max_total_tokens=64),
    )
    [prompt] = random_prompts(1, 40, 40, seed=3)
    params = SamplingParams(
        max_tokens=100
    )  # fits the prefill engine (prompt only), not the decode pool
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    prefill.add_request(GenerateRequest("p0", prompt, params, bootstrap=target))
    with pytest.raises(InvalidRequestError, match="KV cache"):
        decode.add_request(GenerateRequest("d0", prompt, params, bootstrap=target))
    started = time.monotonic()
    outputs = run([prefill, decode], finished(["p0"]))
    assert (
        outputs["p0"][-1].finish_reason.kind == "error"
        and "cancelled" in outputs["p0"][-1].finish_reason.message
    )
    assert time.monotonic() - started < 5
    assert_idle(prefill, decode)


def test_a_room_already_in_use_is_a_409_on_both_engines(tiny_model, make_engine, random_prompts):
    model = tiny_model("llama")
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")
    first, second = random_prompts(2, 10, 10, seed=6)
    # ignore_eos: a sampled end of text would finish it early, as if the 409s had disturbed it
    target = submit_pair(prefill, decode, "0", first, SamplingParams(max_tokens=4, ignore_eos=True))
    for engine in (prefill, decode):
        with pytest.raises(InvalidRequestError, match="already in use") as caught:
            engine.add_request(
                GenerateRequest("again", second, SamplingParams(max_tokens=4), bootstrap=target)
            )
        assert caught.value.status == 409
    outputs = run([prefill, decode], finished(["d0", "p0"]))
    assert len(tokens(outputs, "d0")) == 4  # the first request was not disturbed
    assert_idle(prefill, decode)


def test_a_failed_kv_write_fails_the_request_on_both_engines(
    tiny_model, make_engine, random_prompts, monkeypatch
):
    model = tiny_model("llama")
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")

    def broken(*args):
        raise RuntimeError("injected transfer error")

    monkeypatch.setattr(prefill.role.transfers.agent, "write", broken)
    [prompt] = random_prompts(1, 12, 12, seed=7)
    submit_pair(prefill, decode, "0", prompt, SamplingParams(max_tokens=4))
    outputs = run([prefill, decode], finished(["d0", "p0"]))
    for rid in ("d0", "p0"):
        reason = outputs[rid][-1].finish_reason
        assert (
            reason.kind == "error"
            and reason.status == 502
            and "injected transfer error" in reason.message
        )
    step_until([prefill, decode], lambda: not decode.scheduler.has_work())
    assert_idle(prefill, decode)
    assert decode.role.stats().failures_by_reason == {"transfer": 1}


@pytest.mark.parametrize("differs", ["head_dim", "dtype"])
def test_engines_whose_pools_differ_fail_the_request_with_the_reason(
    differs, tiny_model, make_engine, random_prompts
):
    """Pools whose slots hold other shapes, or the same bytes of another type (float16 KV
    read as bfloat16 would be garbage, silently), refuse each other."""
    if differs == "head_dim":
        prefill = make_engine(tiny_model("llama", head_dim=32), "prefill")
        decode = make_engine(tiny_model("llama"), "decode")
    else:
        prefill = make_engine(tiny_model("llama"), "prefill", dtype="float16")
        decode = make_engine(tiny_model("llama"), "decode", dtype="bfloat16")
    [prompt] = random_prompts(1, 12, 12, seed=7)
    submit_pair(prefill, decode, "0", prompt, SamplingParams(max_tokens=4))
    started = time.monotonic()
    outputs = run([prefill, decode], finished(["d0", "p0"]))
    assert "KV pools differ" in outputs["d0"][-1].finish_reason.message
    assert outputs["p0"][-1].finish_reason.kind == "error"  # released at once, not after a timeout
    assert time.monotonic() - started < 5
    assert_idle(prefill, decode)


def test_a_burst_above_the_decode_engines_capacity_does_not_time_out_queued_rooms(
    tiny_model, make_engine, random_prompts
):
    model = tiny_model("llama")
    # One request at a time: the sixth room waits for five whole answers, several timeouts
    # even on a machine a few times faster than CI's.
    timeout = 1.0
    prefill = make_engine(model, "prefill", disaggregation_timeout=timeout)
    decode = make_engine(model, "decode", max_running_requests=1, disaggregation_timeout=timeout)
    prompts = random_prompts(6, 10, 30, seed=9)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    reference = mixed_reference(model, prompts, [params] * 6, make_engine)
    started = time.monotonic()
    outputs = pd_generate(prefill, decode, prompts, params)
    assert time.monotonic() - started > 2 * timeout  # the last rooms waited well past the timeout
    for i in range(6):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}")
    assert_idle(prefill, decode)


def test_full_pools_taking_rooms_in_opposite_orders_do_not_wait_on_each_other(
    tiny_model, make_engine, random_prompts
):
    """Each pool holds one request at a time and the engines get two rooms in opposite
    orders. A prefill engine that computed the prompt of a room its decode engine had not
    reserved would hold its pool for that room while the decode engine's pool waited for the
    other room's KV, both until the timeout; it computes a prompt only once the decode engine
    has posted the room's slots."""
    model = tiny_model("llama")
    timeout = 60.0
    pools = {"max_total_tokens": 100, "disaggregation_timeout": timeout}
    prefill, decode = make_engine(model, "prefill", **pools), make_engine(model, "decode", **pools)
    prompts = random_prompts(2, 60, 60, seed=13)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reference = mixed_reference(model, prompts, [params] * 2, make_engine)
    port = prefill.role.transfers.link.port
    targets = [BootstrapTarget(next(_rooms), "127.0.0.1", port) for _ in prompts]
    for i in (0, 1):
        decode.add_request(GenerateRequest(f"d{i}", prompts[i], params, bootstrap=targets[i]))
    for i in (1, 0):
        prefill.add_request(GenerateRequest(f"p{i}", prompts[i], params, bootstrap=targets[i]))
    outputs = run([prefill, decode], finished(["d0", "d1", "p0", "p1"]), timeout=timeout / 3)
    for i in (0, 1):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
    assert_idle(prefill, decode)


def test_a_decode_engine_retracts_its_local_requests_never_a_rooms(
    tiny_model, make_engine, random_prompts
):
    """Under memory pressure a decode engine retracts requests it prefilled itself; a room's
    request keeps its whole reservation (the prefill engine writes into its slots), and every
    request still returns what a mixed engine returns."""
    from kubesgl.engine.scheduler.admission import OutputEstimate

    model = tiny_model("llama")
    prompts = random_prompts(6, 15, 25, seed=41)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = mixed_reference(model, prompts, [params] * 6, make_engine)
    prefill = make_engine(model, "prefill")
    decode = make_engine(model, "decode", max_total_tokens=200)
    decode.scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
    port = prefill.role.transfers.link.port
    for i in (0, 1):
        target = BootstrapTarget(next(_rooms), "127.0.0.1", port)
        decode.add_request(GenerateRequest(f"d{i}", prompts[i], params, bootstrap=target))
        prefill.add_request(GenerateRequest(f"p{i}", prompts[i], params, bootstrap=target))
    for i in range(2, 6):
        decode.add_request(GenerateRequest(f"d{i}", prompts[i], params))
    reqs = dict(decode.scheduler.requests)
    outputs = run([prefill, decode], finished([f"d{i}" for i in range(6)] + ["p0", "p1"]))
    for i in range(6):
        assert tokens(outputs, f"d{i}") == tokens(reference, f"m{i}"), i
    assert decode.scheduler.stats().retractions > 0
    assert reqs["d0"].retractions == reqs["d1"].retractions == 0
    assert_idle(prefill, decode)


@pytest.mark.parametrize("where", ["waiting", "compiling its grammar"])
def test_a_room_cancelled_while_its_request_is_queued_frees_it_once(
    where, tiny_model, make_engine, random_prompts, monkeypatch
):
    """The decode side cancels a room (its client left) while the prefill engine has not
    admitted the room's request yet: the request ends once, and is never admitted after."""
    model = tiny_model("llama")
    prefill = make_engine(model, "prefill", max_running_requests=1)
    local_prompt, prompt = random_prompts(2, 30, 40, seed=11)
    busy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prefill.add_request(GenerateRequest("local", local_prompt, busy))  # holds the one running slot
    prefill.step()
    params = SamplingParams(max_tokens=5, temperature=0)
    compiled = None
    if where == "compiling its grammar":
        params = dataclasses.replace(params, grammar=GrammarSpec("json_object"))
        grammars = prefill.scheduler.grammars
        real = grammars.compile(params.grammar)
        compiled = Future()  # done when the test says: the cancel comes while it compiles
        monkeypatch.setattr(grammars, "compile", lambda spec: compiled)
    room = next(_rooms)
    target = BootstrapTarget(room, "127.0.0.1", prefill.role.transfers.link.port)
    prefill.add_request(GenerateRequest("p0", prompt, params, bootstrap=target))
    prefill.role.transfers.link.deliver(RoomCancelled(room, "the client went away"))
    outputs = step_until([prefill], lambda: "p0" not in prefill.scheduler.requests)
    if compiled is not None:
        compiled.set_result(real.result())
    outputs |= step_until([prefill], lambda: not prefill.scheduler.has_work())
    [final] = [out for out in outputs["p0"] if out.finished]
    assert final.finish_reason.kind == "error" and "went away" in final.finish_reason.message
    assert len(outputs["local"]) and outputs["local"][-1].finished
    assert_idle(prefill)
    assert len(prefill.scheduler.requests) == 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_shutdown_closes_the_nixl_agent_before_the_kv_pool_is_freed(
    tiny_model, make_engine, monkeypatch, role
):
    """A write may still be landing in (decode) or reading from (prefill) the pool while the
    agent closes: the pool must outlive the agent's registration of it."""
    engine = make_engine(tiny_model("llama"), role)
    agent = engine.role.transfers.agent
    pool_alive_at_close = []
    real_close = agent.close

    def close():
        pool_alive_at_close.append(hasattr(engine.executor, "runner"))
        real_close()

    monkeypatch.setattr(agent, "close", close)
    engine.shutdown()
    assert pool_alive_at_close == [True]


def test_shutdown_frees_the_pool_even_if_closing_the_role_fails(
    tiny_model, make_engine, monkeypatch, caplog
):
    engine = make_engine(tiny_model("llama"), "prefill")

    def close():
        raise RuntimeError("NIXL went away")

    monkeypatch.setattr(engine.role.transfers.agent, "close", close)
    engine.shutdown()
    assert not hasattr(engine.executor, "runner")
    assert "closing the prefill role failed at shutdown" in caplog.text


def test_a_prefill_engines_prefill_time_ends_at_the_first_token_not_at_the_handoff(
    tiny_model, make_engine, random_prompts
):
    """A prefill engine's kubesgl_request_prefill_time_seconds, queue time and TTFT are its own
    load. The wait for the decode engine's slots (before its prompt) and the KV write (after
    its first token) come with the answer as handoff_seconds (and in
    kubesgl_kv_transfer_wait_seconds), so a saturated decode pool does not read as a slow
    prefill pool (an autoscaler on prefill TTFT would add prefill replicas for it)."""
    model = tiny_model("llama")
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")
    [prompt] = random_prompts(1, 10, 30, seed=61)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    prefill.add_request(GenerateRequest("p0", prompt, params, bootstrap=target))
    req = prefill.scheduler.requests["p0"]
    wait = 0.5  # the decode engine has no slots for it yet: its request comes only now
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        assert not prefill.step()
    assert req.status.name == "WAITING"  # its prompt waits for a place for its KV
    decode.add_request(GenerateRequest("d0", prompt, params, bootstrap=target))
    outputs = run([prefill, decode], finished(["p0", "d0"]))
    [answer] = outputs["p0"]
    assert answer.token_ids and answer.finish_reason.kind == "length"
    assert answer.prefill_seconds is not None and answer.prefill_seconds < wait
    assert answer.queue_seconds is not None and answer.queue_seconds < wait
    assert answer.handoff_seconds is not None and answer.handoff_seconds >= wait
    [first] = [o for o in outputs["d0"] if o.prefill_seconds is not None]
    assert first.handoff_seconds is None  # the decode engine's own first token: no handoff
    assert_idle(prefill, decode)


def test_no_turn_of_an_engine_with_work_to_run_waits_for_events(
    tiny_model, make_engine, random_prompts
):
    """With overlap, turns launch a step, finish the one in flight or release finished
    requests' pages until the work is done; none of them may make the loop wait, and an idle
    turn does."""
    engine = make_engine(tiny_model("llama"), "mixed")
    for i, prompt in enumerate(random_prompts(3, 10, 20, seed=3)):
        engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=1 + i)))
    turns = 0
    while engine.has_work():
        engine.step()
        turns += 1
        assert not engine.scheduler.waits_for_events, turns
    engine.step()  # nothing left: an idle turn
    assert engine.scheduler.waits_for_events


def test_a_room_no_decode_engine_asks_for_times_out_on_the_prefill_engine_uncomputed(
    tiny_model, make_engine, random_prompts
):
    model = tiny_model("llama")
    timeout = 1.0
    prefill = make_engine(model, "prefill", disaggregation_timeout=timeout)
    [prompt] = random_prompts(1, 10, 20, seed=7)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    prefill.add_request(
        GenerateRequest("p0", prompt, SamplingParams(max_tokens=4), bootstrap=target)
    )
    started = time.monotonic()
    outputs = run([prefill], finished(["p0"]))
    assert timeout < time.monotonic() - started < timeout + 5
    [final] = outputs["p0"]
    assert final.finish_reason.kind == "error" and final.finish_reason.status == 504
    assert "no decode engine asked" in final.finish_reason.message
    assert not final.token_ids and prefill.scheduler.stats().prompt_tokens == 0  # never computed
    assert_idle(prefill)


def test_a_prefill_engine_whose_rooms_wait_for_their_slots_waits_for_events_between_turns(
    tiny_model, make_engine, random_prompts
):
    """Its queue holds a request that cannot be admitted until the decode engine posts the
    room's slots: its loop waits for a message (TRANSFER_POLL_MS at most) before each turn
    instead of turning a core busy; once a turn runs a step, the next one follows at once."""
    model = tiny_model("llama")
    prefill = make_engine(model, "prefill")
    [prompt] = random_prompts(1, 10, 20, seed=5)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    params = SamplingParams(max_tokens=4)
    prefill.add_request(GenerateRequest("p0", prompt, params, bootstrap=target))
    assert not prefill.step() and prefill.scheduler.waiting

    class Inbox:  # the loop's socket, its waits recorded
        def __init__(self, socket):
            self.socket, self.waits = socket, []

        def poll(self, timeout=None):
            self.waits.append(timeout)
            return self.socket.poll(timeout)

    endpoints, context = Endpoints.create(), zmq.Context()
    loop = SchedulerLoop(prefill, 0, endpoints, None, context, None)
    socket = loop.inbox
    loop.inbox = inbox = Inbox(socket)  # type: ignore[assignment]
    try:
        assert loop._receive() == []
        assert inbox.waits[0] == TRANSFER_POLL_MS
        prefill.add_request(GenerateRequest("local", prompt, params))  # no room: it runs
        prefill.step()
        assert not prefill.scheduler.waits_for_events
        inbox.waits.clear()
        assert loop._receive() == []
        assert inbox.waits == [0]  # no wait before a turn that has work to run
    finally:
        socket.close(linger=0)
        loop.outbox.close(linger=0)
        context.term()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


def test_an_idle_prefill_engine_answers_a_registration_in_its_next_turn_not_its_idle_wait(
    tiny_model, make_engine, random_prompts
):
    # A decode engine's registration waits until the prefill scheduler has tried to connect to
    # it and every rank has shared how that went, one turn later. With no room open, an idle
    # scheduler would sleep a whole second first (IDLE_POLL_MS) unless it has work.
    model = tiny_model("llama")
    prefill, decode = make_engine(model, "prefill"), make_engine(model, "decode")
    [prompt] = random_prompts(1, 20, 20, seed=3)
    target = BootstrapTarget(next(_rooms), "127.0.0.1", prefill.role.transfers.link.port)
    decode.add_request(
        GenerateRequest("d0", prompt, SamplingParams(max_tokens=4), bootstrap=target)
    )
    transfers = prefill.role.transfers
    step_until([prefill, decode], lambda: bool(transfers._peer_agents))  # connected, not shared
    assert not transfers._rooms and prefill.scheduler.has_work()
    server = transfers.link.service.server
    step_until([prefill, decode], lambda: not server._connecting)  # and it is answered


def test_a_prefill_engines_short_pool_warning_counts_the_prompt_alone():
    """A room's request ends on a prefill engine with its first token: the KV it keeps is its
    prompt's, so the pool's every token is a prompt token (Role.longest_request)."""
    from kubesgl.engine.scheduler.engine import short_pool_warning
    from kubesgl.engine.scheduler.roles import PrefillRole

    config = EngineConfig(model="unused", role="prefill", max_total_tokens=64)
    role = PrefillRole(None, None)  # type: ignore[arg-type]  # longest_request reads neither
    warning = short_pool_warning(config, role, 64, 2048)
    assert warning is not None
    assert "the longest prompt that fits is 64 tokens" in warning
    assert warning.endswith("lower --context-length to 64")
    assert short_pool_warning(config, role, 64, 64) is None
