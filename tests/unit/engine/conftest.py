from __future__ import annotations

import functools
import random

import pytest
import torch


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> transformers' greedy continuation,
    stopping at the model's EOS ids like the engine does."""

    @functools.cache
    def run(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        model = _hf_model(path)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        return tuple(out[0, len(prompt) :].tolist())

    return lambda path, prompt, n: list(run(path, tuple(prompt), n))


@pytest.fixture(scope="session")
def random_prompts():
    """random_prompts(count, min_len, max_len, vocab=600, seed=0) -> lists of token ids."""

    def make(count: int, min_len: int, max_len: int, vocab: int = 600, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]

    return make


@pytest.fixture
def make_llm():
    """make_llm(model_dir, **options) -> LLM in float32 on the CPU. At teardown every step is
    finished, the integrity check runs, and once the cache is flushed every page is free."""
    from kubesgl.engine import LLM

    made = []

    def make(path: str, **options):
        options = {"dtype": "float32", "device": "cpu", "max_total_tokens": 16384, **options}
        llm = LLM(path, **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        _assert_pool_clean(llm)
        llm.shutdown()


@pytest.fixture(scope="session")
def assert_pool_clean():
    return _assert_pool_clean


def _assert_pool_clean(llm) -> None:
    scheduler = llm.engine.scheduler
    scheduler.drain()
    scheduler.check_integrity()
    assert not scheduler.has_work()
    scheduler.kv.flush_cache()
    scheduler.check_integrity()
    allocator = scheduler.kv.allocator
    assert allocator.num_free == allocator.total_pages, "pages still held after every request finished"


@pytest.fixture
def filled_kv_pool():
    """filled_kv_pool(seed, layers=2, kv_heads=2, head_dim=8) -> a bfloat16 KVPool of 64 slots on
    the CPU, random (seed) or zero (seed None): the two ends of a KV transfer."""
    from kubesgl.engine.kvcache.pools import KVPool

    def make(seed: int | None, layers: int = 2, kv_heads: int = 2, head_dim: int = 8) -> KVPool:
        pool = KVPool(64, layers, kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            for t in pool.k + pool.v:
                t.copy_(torch.randn(t.shape, generator=gen))
        return pool

    return make
