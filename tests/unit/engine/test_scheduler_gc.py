"""Scheduler rank 0 decides when a full garbage collection is due and sends it to every rank
in the turn's broadcast, so that tensor-parallel ranks collect in the same turn
(kubesgl/gc_pacing.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq

from kubesgl.engine.ipc import Endpoints, push
from kubesgl.engine.messages import CollectGarbage, GenerateRequest
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.process import SchedulerLoop


class ScriptedPacer:
    """Due when told to be; records what it was asked and whether it collected."""

    def __init__(self):
        self.due_next = False
        self.asked: list[bool] = []
        self.collected = 0

    def due(self, busy: bool) -> bool:
        self.asked.append(busy)
        return self.due_next

    def collect(self) -> None:
        self.collected += 1


def test_rank_0_sends_a_due_collection_in_its_broadcast_and_applies_it(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    endpoints, context = Endpoints.create(), zmq.Context()
    pacer = ScriptedPacer()
    loop = SchedulerLoop(engine, 0, endpoints, None, context, None, pacer)  # type: ignore[arg-type]
    api = push(context, endpoints.scheduler_in)
    try:
        assert loop._receive() == [] and pacer.asked == [False]  # idle, nothing due
        api.send_pyobj(GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=1)))
        pacer.due_next = True
        messages = loop._receive()
        assert pacer.asked[-1] is True  # a request arrived: busy, though none runs yet
        assert [type(m) for m in messages] == [GenerateRequest, CollectGarbage]
        for message in messages:
            loop._apply(message)
        assert pacer.collected == 1
        while engine.has_work():
            engine.step()
    finally:
        api.close(linger=0)
        loop.inbox.close(linger=0)
        loop.outbox.close(linger=0)
        context.term()
        shutil.rmtree(Path(endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True)
