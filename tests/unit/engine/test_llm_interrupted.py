"""A generate call that fails ends its requests; a failure of the step in flight on the way
out is logged, not raised over the call's own error."""

from __future__ import annotations

import logging

import pytest

from kubesgl.engine import LLM
from kubesgl.engine.sampling_params import SamplingParams


def test_a_failed_drain_after_a_failed_step_is_logged_and_the_steps_error_raised(
    tiny_model, monkeypatch, caplog
):
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", max_total_tokens=4096)

    def fail(message: str):
        def raise_it():
            raise RuntimeError(message)

        return raise_it

    monkeypatch.setattr(llm.engine, "step", fail("the step failed"))
    monkeypatch.setattr(llm.engine.scheduler, "drain", fail("the drain failed"))
    with (
        caplog.at_level(logging.DEBUG, logger="kubesgl.engine.llm"),
        pytest.raises(RuntimeError, match="the step failed"),
    ):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    monkeypatch.undo()
    (record,) = [r for r in caplog.records if r.name == "kubesgl.engine.llm"]
    assert record.levelno == logging.DEBUG and "the drain failed" in str(record.exc_info[1])
    llm.shutdown()
