"""One request's failure stays that request's: the tokenizer/detokenizer loop and the
scheduler turn an exception raised for one request into its error answer, and every other
request goes on (issue: a lone surrogate crashed the whole engine)."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import TypeAdapter, ValidationError
from test_scheduler import run_to_end, submit

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.messages import (
    AbortRequest,
    BootstrapTarget,
    GenerateRequest,
    RoomRefused,
    StepOutputs,
    TextBatch,
    TokenizeRequest,
    TokenOutput,
)
from kubesgl.engine.sampling_params import is_utf8
from kubesgl.engine.server.protocol import JsonText
from kubesgl.engine.tokenizer.process import Tokenizer, TokenizerLoop


class Outbox:
    def __init__(self):
        self.sent = []

    def send_pyobj(self, message):
        self.sent.append(message)


@pytest.fixture
def loop(tiny_model):
    tokenizer = Tokenizer(tiny_model("llama"))
    return TokenizerLoop(tokenizer, Outbox(), Outbox())


def test_a_request_the_tokenizer_raises_on_gets_a_500_and_the_next_one_goes_through(
    loop, monkeypatch
):
    encode = loop.tokenizer.encode

    def flaky(request):
        if request.rid == "poison":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return encode(request)

    monkeypatch.setattr(loop.tokenizer, "encode", flaky)
    assert loop.from_api(TokenizeRequest("poison", SamplingParams(), text="x"))
    assert loop.from_api(TokenizeRequest("fine", SamplingParams(), text="hello"))
    [error] = loop.to_api.sent
    reason = error.outputs[0].finish_reason
    assert error.outputs[0].rid == "poison" and reason.kind == "error" and reason.status == 500
    assert "TypeError" in reason.message
    [request] = loop.to_scheduler.sent
    assert isinstance(request, GenerateRequest) and request.rid == "fine" and request.input_ids


def test_a_bad_request_is_a_400_that_names_the_field(loop):
    loop.tokenizer.hf.chat_template = None
    loop.from_api(
        TokenizeRequest("chat", SamplingParams(), messages=[{"role": "user", "content": "hi"}])
    )
    reason = loop.to_api.sent[0].outputs[0].finish_reason
    assert (reason.status, reason.param) == (400, "messages")
    assert loop.to_scheduler.sent == []  # no room: nothing for the scheduler


def test_a_refused_request_for_a_room_ends_the_room_in_the_scheduler(loop):
    """The scheduler never sees the request, but a prefill engine's role must end its room:
    the decode engine waits for its KV (docs/disaggregation.md)."""
    loop.tokenizer.hf.chat_template = None
    target = BootstrapTarget(7, None, 8998)
    chat = [{"role": "user", "content": "hi"}]
    loop.from_api(TokenizeRequest("chat", SamplingParams(), messages=chat, bootstrap=target))
    reason = loop.to_api.sent[0].outputs[0].finish_reason
    assert loop.to_scheduler.sent == [RoomRefused(target, reason.message, 400)]


def test_a_failing_detokenization_fails_its_request_and_aborts_it_in_the_scheduler(
    loop, monkeypatch
):
    for rid in ("a", "b"):
        loop.from_api(TokenizeRequest(rid, SamplingParams(), text="hello"))
    decode = loop.tokenizer.decode

    def flaky(out):
        if out.rid == "a":
            raise RuntimeError("boom")
        return decode(out)

    monkeypatch.setattr(loop.tokenizer, "decode", flaky)
    loop.from_scheduler(StepOutputs([TokenOutput("a", [5]), TokenOutput("b", [6])], stats=None))
    [batch] = [m for m in loop.to_api.sent if isinstance(m, TextBatch)]
    by_rid = {out.rid: out for out in batch.outputs}
    assert by_rid["a"].finish_reason.kind == "error" and by_rid["a"].finish_reason.status == 500
    assert by_rid["b"].finish_reason is None and by_rid["b"].token_ids == [6]
    assert [m.rid for m in loop.to_scheduler.sent if isinstance(m, AbortRequest)] == ["a"]
    assert "a" not in loop.tokenizer.states


def test_stop_strings_that_are_not_utf8_are_refused_before_they_reach_the_scheduler_loop():
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(stop=["ok", "\ud800"]).validate(100)
    assert caught.value.param == "stop"


@pytest.mark.parametrize(
    "escapes",
    [
        r"\ud800",
        r"\uDFFF",
        r"\ud83d\ude00",  # a pair: one character
        r"\uD83D\uDE00",
        r"\ud83d\ud83d\ude00",
        r"\ud83dx",
        r"\\ud800",  # an escaped backslash, then text
        r"\\\ud800",
        r"\\\\ud800",
        r"\ud83d\\ude00",
        r"\u00e9\n\"",
    ],
)
def test_a_schema_given_as_text_is_refused_for_the_lone_surrogates_a_json_reader_finds(escapes):
    """What the server refuses in a schema given as text is what the parsed text holds, a
    lone surrogate in a string or a key, and nothing else."""
    text = f'{{"enum": ["{escapes}"], "{escapes}": 1}}'
    lone = not is_utf8(json.loads(text)["enum"][0])
    try:
        TypeAdapter(JsonText).validate_python(text)
        refused = False
    except ValidationError as error:
        refused = error.errors()[0]["type"] == "invalid_utf8"
    assert refused == lone


@pytest.mark.parametrize(
    "text",
    [
        '{"description": "\\ud83d\\ude00' + "\\n" * 1_000_000 + '"}',
        '{"description": "' + "\\ud83d\\ude00" * 160_000 + '"}',
    ],
    ids=["escapes-after-a-pair", "pairs"],
)
def test_a_schema_text_full_of_escapes_is_checked_at_the_cost_of_a_parse(text):
    """2 MB of escapes after a surrogate pair, or of pairs: the check runs on the event loop,
    where reading each escape in Python took 100-200 ms, 15 to 70 parses of the text."""

    def seconds(check) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            check(text)
            best = min(best, time.perf_counter() - start)
        return best

    parse = seconds(json.loads)
    checked = seconds(TypeAdapter(JsonText).validate_python)
    assert checked < 10 * parse, f"{checked * 1000:.1f} ms, a parse {parse * 1000:.1f} ms"


def test_an_exception_while_checking_one_request_fails_it_alone(
    tiny_model, make_llm, random_prompts, monkeypatch
):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    checker = engine.scheduler.stop_checker
    match = checker.match

    def flaky(req):
        if req.rid == "poison":
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return match(req)

    monkeypatch.setattr(checker, "match", flaky)
    prompts = random_prompts(3, 4, 12, seed=3)
    submit(engine, "poison", prompts[0], max_tokens=8, stop=["zz"], ignore_eos=True)
    submit(engine, "ok1", prompts[1], max_tokens=8, stop=["zz"], ignore_eos=True)
    submit(engine, "ok2", prompts[2], max_tokens=8, ignore_eos=True)
    outputs = run_to_end(engine)
    poison = outputs["poison"][-1].finish_reason
    assert (
        poison.kind == "error" and poison.status == 500 and "UnicodeEncodeError" in poison.message
    )
    for rid in ("ok1", "ok2"):
        assert (
            sum(len(o.token_ids) for o in outputs[rid]) == 8
            and outputs[rid][-1].finish_reason.kind == "length"
        )
