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
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False
            )
        return tuple(out[0, len(prompt) :].tolist())

    return lambda path, prompt, n: list(run(path, tuple(prompt), n))


@pytest.fixture(scope="session")
def random_prompts():
    """random_prompts(count, min_len, max_len, vocab=600, seed=0) -> lists of token ids."""

    def make(
        count: int, min_len: int, max_len: int, vocab: int = 600, seed: int = 0
    ) -> list[list[int]]:
        rng = random.Random(seed)
        return [
            [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(count)
        ]

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
    assert allocator.num_free == allocator.total_pages, (
        "pages still held after every request finished"
    )


@pytest.fixture
def filled_kv_pool():
    """filled_kv_pool(seed, layers=2, kv_heads=2, head_dim=8, device="cpu") -> a bfloat16 KVPool
    of 64 slots, random (seed) or zero (seed None): the two ends of a KV transfer."""
    from kubesgl.engine.kvcache.pools import KVPool

    def make(
        seed: int | None, layers: int = 2, kv_heads: int = 2, head_dim: int = 8, device="cpu"
    ) -> KVPool:
        pool = KVPool(64, layers, kv_heads, head_dim, torch.bfloat16, torch.device(device))
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            for t in pool.k + pool.v:
                t.copy_(torch.randn(t.shape, generator=gen))
        return pool

    return make


@pytest.fixture(scope="session")
def long_prompt_while_decoding(hf_greedy, random_prompts):
    """long_prompt_while_decoding(llm, path, seed) -> (modes, logprobs): a long prompt arrives
    while three requests decode. Every request's greedy tokens must equal transformers'; the
    long prompt starts with the first short one and must reuse its cached KV; the first short
    one asks for logprobs (returned), whose tokens must be the ones sent. With mixed chunks on,
    no step may leave the decodes out while the long prompt is prefilled, and the steps that
    carry both fill --chunked-prefill-size exactly. `modes`: the ForwardMode names of the
    steps launched after the long prompt arrived."""
    from kubesgl.engine import SamplingParams
    from kubesgl.engine.messages import GenerateRequest

    def run(llm, path: str, seed: int, max_tokens: int = 12, long_len: int = 100):
        engine = llm.engine
        modes: list[str] = []
        launch = engine.executor.launch
        step_tokens: list[int] = []

        def recorded(batch):
            modes.append(batch.mode.name)
            step_tokens.append(batch.num_tokens)
            return launch(batch)

        engine.executor.launch = recorded
        shorts = random_prompts(3, 16, 24, seed=seed)
        prompts = {f"short{i}": p for i, p in enumerate(shorts)}
        prompts["long"] = shorts[0] + random_prompts(1, long_len, long_len, seed=seed + 1)[0]
        outputs: dict[str, list] = {rid: [] for rid in prompts}

        def submit(rid: str, **params) -> None:
            engine.add_request(
                GenerateRequest(
                    rid=rid,
                    input_ids=prompts[rid],
                    params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                )
            )

        def step() -> None:
            for out in engine.step():
                outputs[out.rid].append(out)

        submit("short0", logprobs=2)
        submit("short1")
        submit("short2")
        while not all(outputs[f"short{i}"] for i in range(3)):  # all three are decoding
            step()
        modes.clear()
        step_tokens.clear()
        submit("long")
        while engine.has_work():
            step()
        engine.executor.launch = launch
        tokens = {rid: [t for out in outs for t in out.token_ids] for rid, outs in outputs.items()}
        for rid, prompt in prompts.items():
            assert tokens[rid] == hf_greedy(path, prompt, max_tokens), rid
        page = engine.scheduler.kv.page_size
        assert outputs["long"][-1].cached_tokens == len(shorts[0]) // page * page
        logprobs = [lp for out in outputs["short0"] for lp in out.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens["short0"]
        assert all(lp.top[0][0] == lp.token_id for lp in logprobs)  # greedy: the most likely token
        budget = engine.scheduler.limits.chunked_prefill_size
        if engine.scheduler.limits.mixed_chunk:
            assert "EXTEND" not in modes and modes.count("MIXED") >= 2, modes
            assert max(step_tokens) == budget, (
                step_tokens
            )  # the decodes' tokens and the chunk fill the budget
        return modes, logprobs

    return run
