"""The Llama-3.1-8B shape (dummy weights, bfloat16) with each GPU attention backend, CUDA
graphs on: the first token's distribution within bfloat16 rounding of the torch backend's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gpu_backends import BACKENDS

from kubesgl.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
LLAMA_8B = str(Path(__file__).resolve().parents[2] / "benchmarks/models/llama-3.1-8b")
PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True)


def generate(backend: str):
    rng = random.Random(5)
    batch = [[rng.randrange(3, 128000) for _ in range(rng.randint(1, 150))] for _ in range(4)]
    with LLM(
        LLAMA_8B,
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=backend,
        max_total_tokens=8192,
        max_running_requests=8,
        context_length=1024,
    ) as llm:
        outputs = llm.generate(batch, PARAMS)
    torch.cuda.empty_cache()
    return outputs


@pytest.fixture(scope="module")
def reference():
    return generate("torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_token_distribution_within_bf16_tolerance(backend, reference):
    for ref, got in zip(reference, generate(backend)):
        # first token: same context, so the distributions must agree within bf16 rounding
        ref_top, got_top = dict(ref.logprobs[0].top), dict(got.logprobs[0].top)
        shared = set(ref_top) & set(got_top)
        assert len(shared) >= 4
        assert max(abs(ref_top[t] - got_top[t]) for t in shared) < 0.1
