"""The Triton backend and CUDA graphs on the GPU: the same greedy tokens as the torch
backend in float32, graphs equal to eager (the 8B shape: test_llama8b_shape.py)."""

from __future__ import annotations

import random

import pytest

from kubesgl.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def prompts(count: int, seed: int, vocab: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 150))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_triton_backend_greedy_equals_torch_backend(arch, cuda_graph, tiny_model):
    path = tiny_model(arch)
    batch = prompts(12, seed=3)
    params = SamplingParams(max_tokens=32, temperature=0)
    common = dict(
        device="cuda",
        dtype="float32",
        page_size=16,
        max_total_tokens=16384,
        max_running_requests=16,
    )
    with LLM(path, attention_backend="torch", **common) as reference:
        expected = [o.token_ids for o in reference.generate(batch, params)]
    with LLM(path, attention_backend="triton", disable_cuda_graph=not cuda_graph, **common) as llm:
        assert (llm.engine.executor.runner.cuda_graphs is not None) == cuda_graph
        got = [o.token_ids for o in llm.generate(batch, params)]
        again = [o.token_ids for o in llm.generate(batch, params)]  # served from the prefix cache
        llm.engine.scheduler.drain()
        llm.engine.scheduler.check_integrity()
    assert got == expected and again == expected
