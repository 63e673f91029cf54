"""The API server's end of the engine: every output of a request reaches its reader, also
when several arrive before the reader runs."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import zmq

from kubesgl.engine.ipc import Endpoints, push
from kubesgl.engine.messages import FinishReason, TextBatch, TextOutput, TokenizeRequest
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.server.engine_client import EngineClient, EngineGone


@pytest.fixture
async def client():
    endpoints = Endpoints.create()
    engine_client = EngineClient(endpoints, EngineMetrics("mixed"))
    engine_client.start()
    detokenizer = push(zmq.Context.instance(), endpoints.api_in)
    yield engine_client, detokenizer
    await engine_client.shutdown()
    detokenizer.close(linger=0)
    await engine_client.aclose()
    shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.mark.asyncio
async def test_outputs_that_arrive_together_all_reach_the_reader(client):
    engine_client, detokenizer = client
    stream = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    # The first token and the last arrive in one batch, before the reader has run once.
    detokenizer.send_pyobj(
        TextBatch(
            [
                TextOutput("r1", "a", [5], None, 3, 0, 1),
                TextOutput("r1", "b", [6], FinishReason("length"), 3, 0, 2),
            ]
        )
    )
    outputs = [out async for out in stream]
    assert [out.token_ids for out in outputs] == [[5], [6]]
    assert outputs[-1].finish_reason.kind == "length"


@pytest.mark.asyncio
async def test_the_gc_pacer_starts_when_the_engine_is_ready_and_hears_whether_requests_run(
    recording_pacer,
):
    from kubesgl.engine.messages import EngineInfo

    endpoints = Endpoints.create()
    pacer = recording_pacer
    engine_client = EngineClient(endpoints, EngineMetrics("mixed"), pacer)  # type: ignore[arg-type]
    engine_client.start()
    detokenizer = push(zmq.Context.instance(), endpoints.api_in)
    try:
        await asyncio.sleep(0.05)
        assert (pacer.started, pacer.ticks) == (0, [])  # start-up is not over
        detokenizer.send_pyobj(EngineInfo("m", 4096, 100, 1000, 1, "LlamaForCausalLM", [2]))
        await asyncio.wait_for(engine_client.ready.wait(), 5)
        await asyncio.sleep(0.05)
        assert pacer.started == 1 and pacer.ticks and not any(pacer.ticks)
        stream = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert pacer.ticks[-1] is True  # a request in flight
        detokenizer.send_pyobj(
            TextBatch([TextOutput("r1", "a", [5], FinishReason("stop"), 3, 0, 1)])
        )
        await first
        await stream.aclose()
        await asyncio.sleep(0.05)
        assert pacer.ticks[-1] is False
    finally:
        await engine_client.shutdown()
        detokenizer.close(linger=0)
        await engine_client.aclose()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.mark.asyncio
async def test_leaving_the_client_closes_its_sockets_and_still_delivers_a_shutdown_just_sent():
    from kubesgl.engine.ipc import pull
    from kubesgl.engine.messages import Shutdown

    endpoints = Endpoints.create()
    tokenizer = pull(zmq.Context.instance(), endpoints.tokenizer_in)
    try:
        async with EngineClient(endpoints, EngineMetrics("mixed")) as engine_client:
            engine_client.start()
            await engine_client.shutdown()
        assert engine_client._context.closed
        assert tokenizer.poll(2000) and isinstance(tokenizer.recv_pyobj(), Shutdown)
    finally:
        tokenizer.close(linger=0)
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.mark.asyncio
async def test_shutdown_and_aclose_do_their_work_once_whichever_runs_again_or_later(monkeypatch):
    """The launcher's drain and its serve loop may both shut down, and the with-block's exit
    closes after them: one Shutdown goes to the engine, the context is terminated once (a
    second term() while the first waits never returns), and a shutdown after the close, whose
    socket is gone, does nothing."""
    from kubesgl.engine.ipc import pull
    from kubesgl.engine.messages import Shutdown

    endpoints = Endpoints.create()
    tokenizer = pull(zmq.Context.instance(), endpoints.tokenizer_in)
    engine_client = EngineClient(endpoints, EngineMetrics("mixed"))
    terms: list[None] = []
    term = engine_client._context.term

    def term_once() -> None:
        terms.append(None)
        if len(terms) == 1:  # a second would hang (or abort) the test
            term()

    monkeypatch.setattr(engine_client._context, "term", term_once)
    try:
        engine_client.start()
        await engine_client.shutdown()
        await engine_client.shutdown()
        await asyncio.gather(engine_client.aclose(), engine_client.aclose())
        await engine_client.shutdown()
        await engine_client.aclose()
        assert engine_client._context.closed and len(terms) == 1
        assert tokenizer.poll(2000) and isinstance(tokenizer.recv_pyobj(), Shutdown)
        assert not tokenizer.poll(200)
    finally:
        tokenizer.close(linger=0)
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.mark.asyncio
async def test_a_request_id_stays_taken_until_the_engine_has_ended_its_request(client):
    """A client that leaves and retries at once with the same rid (SGLang's /generate takes
    one) must not get the first request's abort, nor leave the second without a reader."""
    from kubesgl.engine.server.engine_client import DuplicateRequestId

    engine_client, detokenizer = client
    first = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    detokenizer.send_pyobj(TextBatch([TextOutput("r1", "a", [5], None, 3, 0, 1)]))
    await anext(first)
    await first.aclose()  # the client left: the request is aborted, its end is on its way
    with pytest.raises(DuplicateRequestId, match="still"):
        engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    detokenizer.send_pyobj(TextBatch([TextOutput("r1", "", [], FinishReason("abort"), 3, 0, 1)]))
    async with asyncio.timeout(5):
        while engine_client.in_flight:
            await asyncio.sleep(0.01)
    second = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    detokenizer.send_pyobj(TextBatch([TextOutput("r1", "b", [6], FinishReason("length"), 3, 0, 1)]))
    outputs = [out async for out in second]
    assert [(out.text, out.finish_reason.kind) for out in outputs] == [("b", "length")]


@pytest.mark.asyncio
async def test_a_request_in_flight_when_the_engine_stops_ends_with_a_500(client):
    """Not a 503, which routers retry on another engine: the request may be what broke this one."""
    engine_client, _ = client
    stream = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)  # the request has been sent: it is in flight
    engine_client.fail_all("the engine stopped: scheduler rank 0 exited with code -9")
    reason = (await first).finish_reason
    assert (reason.kind, reason.status) == ("error", 500)
    assert reason.message == "the engine stopped: scheduler rank 0 exited with code -9"
    await stream.aclose()


@pytest.mark.asyncio
async def test_a_request_that_comes_once_the_engine_has_stopped_is_refused_at_once(client):
    """Between the failure and the server's stop, a new request waited for outputs that
    would never come, until the server's shutdown timeout cancelled it (a 500 and a
    traceback, 5 s later)."""
    engine_client, _ = client
    engine_client.fail_all("the engine stopped: scheduler rank 0 exited with code -9")
    assert engine_client.failure == "the engine stopped: scheduler rank 0 exited with code -9"
    with pytest.raises(EngineGone, match="scheduler rank 0 exited"):
        engine_client.generate(TokenizeRequest("r2", SamplingParams()))
    assert engine_client.in_flight == 0


@pytest.mark.asyncio
async def test_a_flush_answers_what_the_scheduler_did(client):
    """The scheduler skips a flush while it has work the API server does not see (requests
    its clients left, rooms of P/D transfers): /flush_cache said "flushed" all the same."""
    from kubesgl.engine.messages import CacheFlushed

    engine_client, detokenizer = client
    skipped = asyncio.ensure_future(engine_client.flush_cache())
    done = asyncio.ensure_future(engine_client.flush_cache())
    await asyncio.sleep(0.05)
    detokenizer.send_pyobj(CacheFlushed(0, False))
    detokenizer.send_pyobj(CacheFlushed(1, True))
    assert (await skipped, await done) == (False, True)
    gone = asyncio.ensure_future(engine_client.flush_cache())
    await asyncio.sleep(0.05)
    engine_client.fail_all("the scheduler died")
    with pytest.raises(EngineGone, match="the scheduler died"):
        await gone
    with pytest.raises(EngineGone, match="the scheduler died"):  # at once, not after a timeout
        await asyncio.wait_for(engine_client.flush_cache(), 1)


@pytest.mark.asyncio
async def test_each_flush_gets_its_own_answer_also_after_a_caller_gave_up(client):
    """Answers are matched by the flush's id, not by their order: one whose caller left (a
    timeout, a client gone) is dropped, and nothing waits for it afterwards."""
    from kubesgl.engine.messages import CacheFlushed

    engine_client, detokenizer = client
    abandoned = asyncio.ensure_future(engine_client.flush_cache())
    kept = asyncio.ensure_future(engine_client.flush_cache())
    await asyncio.sleep(0.05)
    abandoned.cancel()
    detokenizer.send_pyobj(CacheFlushed(1, True))  # the kept flush's answer comes first
    detokenizer.send_pyobj(CacheFlushed(0, False))
    assert await kept is True
    await asyncio.sleep(0.05)
    assert engine_client._flushes == {}


@pytest.mark.asyncio
async def test_a_reader_that_fails_takes_the_server_down_with_its_exception(client, monkeypatch):
    """Nothing awaits the reader of the engine's outputs: when it raised, every request in flight
    waited forever, and the server stayed "loading" (or, once ready, was said to have hung)."""
    import threading
    import types

    from kubesgl.engine.config import EngineConfig
    from kubesgl.engine.server.launcher import Server, ServerOptions

    engine_client, detokenizer = client
    server = Server(EngineConfig(model="unused"), ServerOptions())
    shutil.rmtree(Path(server.endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)
    uvicorn_server = types.SimpleNamespace(should_exit=False)
    watch = threading.Thread(
        target=server._watch_children,
        args=(uvicorn_server, engine_client, asyncio.get_running_loop()),
        daemon=True,
    )
    watch.start()

    def broken(pending, out):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(engine_client, "_account", broken)
    stream = engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)  # sent: in flight
    detokenizer.send_pyobj(TextBatch([TextOutput("r1", "a", [5], None, 3, 0, 1)]))
    try:
        async with asyncio.timeout(5):
            reason = (await first).finish_reason
    finally:
        server._stopping.set()
        watch.join(1)
    assert (reason.kind, reason.status) == ("error", 500)
    assert "RuntimeError('a bug in the reader')" in reason.message
    assert uvicorn_server.should_exit and server.exit_code == 1
    await stream.aclose()


@pytest.mark.asyncio
async def test_tokenizer_calls_get_their_own_answers_and_end_when_the_engine_stops(client):
    """/tokenize and /detokenize wait for the tokenizer process's answer by the call's id; a
    call in flight when the engine's processes go away, or made after, fails at once."""
    from kubesgl.engine.messages import Tokenized

    engine_client, detokenizer = client
    first = asyncio.ensure_future(engine_client.tokenizer_call(token_ids=[5]))
    second = asyncio.ensure_future(engine_client.tokenizer_call(token_ids=[6]))
    await asyncio.sleep(0.05)
    detokenizer.send_pyobj(Tokenized(1, text="six"))
    detokenizer.send_pyobj(Tokenized(0, text="five"))
    assert ((await first).text, (await second).text) == ("five", "six")
    gone = asyncio.ensure_future(engine_client.tokenizer_call(token_ids=[7]))
    await asyncio.sleep(0.05)
    engine_client.fail_all("the tokenizer died")
    with pytest.raises(EngineGone, match="the tokenizer died"):
        await gone
    with pytest.raises(EngineGone, match="the tokenizer died"):
        await asyncio.wait_for(engine_client.tokenizer_call(token_ids=[8]), 1)


@pytest.mark.asyncio
async def test_user_requests_leave_health_probes_out(client):
    """/flush_cache refuses while users' requests run; a /health_generate probe is none."""
    engine_client, _ = client
    engine_client.generate(TokenizeRequest("health-1", SamplingParams(), probe=True))
    assert (engine_client.in_flight, engine_client.user_requests) == (1, 0)
    engine_client.generate(TokenizeRequest("r1", SamplingParams()))
    assert (engine_client.in_flight, engine_client.user_requests) == (2, 1)
    await engine_client.close("health-1")  # not sent yet: forgotten
    await engine_client.close("r1")
