"""The Triton backend and CUDA graphs on the GPU: the same greedy tokens as the torch
backend in float32, graphs equal to eager, and bfloat16 logits of the 8B shape within
tolerance of the torch backend."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kubesgl.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
LLAMA_8B = str(Path(__file__).resolve().parents[2] / "benchmarks/models/llama-3.1-8b")


def prompts(count: int, seed: int, vocab: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 150))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_triton_backend_greedy_equals_torch_backend(arch, cuda_graph, tiny_model):
    path = tiny_model(arch)
    batch = prompts(12, seed=3)
    params = SamplingParams(max_tokens=32, temperature=0)
    common = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=16384, max_running_requests=16)
    with LLM(path, attention_backend="torch", **common) as reference:
        expected = [o.token_ids for o in reference.generate(batch, params)]
    with LLM(path, attention_backend="triton", disable_cuda_graph=not cuda_graph, **common) as llm:
        assert (llm.engine.executor.runner.cuda_graphs is not None) == cuda_graph
        got = [o.token_ids for o in llm.generate(batch, params)]
        again = [o.token_ids for o in llm.generate(batch, params)]  # served from the prefix cache
        llm.engine.scheduler.drain()
        llm.engine.scheduler.check_integrity()
    assert got == expected and again == expected


def test_llama_8b_shape_triton_and_graphs_within_bf16_tolerance():
    batch = prompts(4, seed=5, vocab=128000)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM(LLAMA_8B, load_format="dummy", dtype="bfloat16", attention_backend=backend, max_total_tokens=8192,
                 max_running_requests=8, context_length=1024) as llm:
            results[backend] = llm.generate(batch, params)
        torch.cuda.empty_cache()
    for ref, got in zip(results["torch"], results["triton"]):
        # first token: same context, so the distributions must agree within bf16 rounding
        ref_top, got_top = dict(ref.logprobs[0].top), dict(got.logprobs[0].top)
        shared = set(ref_top) & set(got_top)
        assert len(shared) >= 4
        assert max(abs(ref_top[t] - got_top[t]) for t in shared) < 0.1
