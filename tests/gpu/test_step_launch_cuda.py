"""Launching a step never waits for the device. With overlap the host builds and queues step
N+1 while step N runs; one blocking copy (a tensor made from a list on the device, `.item()`)
in ModelRunner.run makes it wait for step N instead, and the device then idles while the rest
of step N+1 is launched: on an H200 that cost a mixed step of the 8B shape about 3.6 ms
(benchmarks/README.md). Here every step runs under torch's sync debug mode, which raises on
the synchronizing calls torch detects (not all: event waits and copies from pageable memory
pass unseen)."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_backends import BACKENDS

from kubesgl.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("piecewise", [False, True], ids=["eager", "piecewise"])
# FlashInfer attends a mixed step of a chunk of at most 256 tokens in one pass, else in two
@pytest.mark.parametrize("budget", [64, 512])
def test_no_step_waits_for_the_device_while_it_is_launched(backend, piecewise, budget, tiny_model):
    path = tiny_model("llama", head_dim=64)
    options = dict(
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
        max_total_tokens=32768,
        max_running_requests=16,
        chunked_prefill_size=budget,
        enable_mixed_chunk=True,
        enable_piecewise_cuda_graph=piecewise,
        disable_overlap_schedule=True,  # the executor runs on this thread, in the debug mode
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randint(8, 600))] for _ in range(10)]
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
    ]
    with LLM(path, **options) as llm:
        runner = llm.engine.executor.runner
        launch, modes = runner.run, []

        def strict(batch):
            modes.append(batch.mode.name)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.run = strict
        outputs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))])
    assert all(len(out.token_ids) == 24 for out in outputs)
    assert {"EXTEND", "MIXED", "DECODE"} <= set(modes), modes
