"""The scheduler process applies each message a turn brings through its handler
(engine/scheduler/process.py, _HANDLERS): every message the tokenizer sends it has one, each
reaches its own engine call, and a message of any other type is an error, not a request."""

from __future__ import annotations

from typing import get_args

import pytest

from kubesgl.engine.messages import (
    AbortRequest,
    BootstrapTarget,
    CollectGarbage,
    FlushCache,
    GenerateRequest,
    RoomRefused,
    Shutdown,
    TokenizeRequest,
)
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.process import _HANDLERS, SchedulerLoop, SchedulerMessage
from kubesgl.engine.tokenizer.process import Tokenizer, TokenizerLoop


class Recorder:
    """Stands in for the engine, its role and scheduler, and the GC pacer: records each call."""

    def __init__(self):
        self.calls: list[str] = []
        self.role, self.scheduler = self, self

    def add_request(self, request):
        self.calls.append("add_request")

    def abort_request(self, rid, message):
        self.calls.append("abort_request")
        return []

    def refused(self, target, message, status):
        self.calls.append("refused")

    def has_work(self):
        return False

    def reset(self):
        self.calls.append("reset")

    def collect(self):
        self.calls.append("collect")


def _loop(recorder: Recorder) -> SchedulerLoop:
    """A rank other than 0: it owns no sockets, so no endpoints or context are needed."""
    return SchedulerLoop(recorder, 1, None, None, None, None, recorder)  # type: ignore[arg-type]


def test_every_message_a_turn_applies_has_its_handler():
    assert set(_HANDLERS) == set(get_args(SchedulerMessage))


_TARGET = BootstrapTarget(7, None, 8998)


@pytest.mark.parametrize(
    ("message", "call"),
    [
        (GenerateRequest("r", [1, 2], SamplingParams()), "add_request"),
        (AbortRequest("r"), "abort_request"),
        (RoomRefused(_TARGET, "too long", 400), "refused"),
        (FlushCache(1), "reset"),
        (CollectGarbage(), "collect"),
    ],
)
def test_each_message_reaches_its_own_engine_call(message, call):
    recorder = Recorder()
    assert _loop(recorder)._apply(message) == []
    assert recorder.calls == [call]


def test_an_unknown_message_is_an_error_not_a_request():
    recorder = Recorder()
    with pytest.raises(TypeError, match="not a message for the scheduler"):
        _loop(recorder)._apply(TokenizeRequest("r", SamplingParams(), text="hi"))  # type: ignore[arg-type]
    assert recorder.calls == []


class Outbox:
    def __init__(self):
        self.sent: list = []

    def send_pyobj(self, message):
        self.sent.append(message)


def test_the_tokenizer_sends_the_scheduler_only_messages_it_reads(tiny_model):
    """What reaches scheduler rank 0 from the tokenizer: a turn's messages, or Shutdown."""
    tokenizer = TokenizerLoop(Tokenizer(tiny_model("llama")), Outbox(), Outbox())
    tokenizer.tokenizer.hf.chat_template = None  # a chat request is refused: RoomRefused
    chat = [{"role": "user", "content": "hi"}]
    for message in (
        TokenizeRequest("r", SamplingParams(), text="hello"),
        TokenizeRequest("c", SamplingParams(), messages=chat, bootstrap=_TARGET),
        AbortRequest("r"),
        FlushCache(1),
        Shutdown(),
    ):
        tokenizer.from_api(message)
    sent = {type(message) for message in tokenizer.to_scheduler.sent}
    assert sent == {GenerateRequest, RoomRefused, AbortRequest, FlushCache, Shutdown}
    assert sent <= set(get_args(SchedulerMessage)) | {Shutdown}
