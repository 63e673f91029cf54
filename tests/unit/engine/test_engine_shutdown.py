"""Shutting an engine down frees what it holds on the device, even while the object lives on
(an offline LLM kept in a notebook), and it takes no requests afterwards."""

from __future__ import annotations

import weakref

import pytest

from kubesgl.engine import LLM
from kubesgl.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("overlap", [True, False])
def test_shutdown_lets_go_of_the_model_the_kv_pool_and_the_runner(tiny_model, overlap):
    llm = LLM(
        tiny_model("llama"),
        dtype="float32",
        device="cpu",
        max_total_tokens=4096,
        disable_overlap_schedule=not overlap,
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    runner = llm.engine.executor.runner
    held = [weakref.ref(x) for x in (runner, runner.model, runner.kv_pool, runner.req_to_token)]
    del runner
    llm.shutdown()
    assert [ref() is None for ref in held] == [True] * len(held)
    assert llm.engine.shut_down


def test_a_shut_down_engine_refuses_requests_and_shuts_down_once(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", max_total_tokens=4096)
    llm.shutdown()
    llm.shutdown()  # a second call (and the with-block's exit) does nothing
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
