"""Piecewise CUDA graphs' pieces and buffers against the whole model: on the CPU each piece
runs eagerly in place of its graph, so what is checked here is the cut at attention, the
hand-over through fixed buffers and the padding to a captured token count (the graphs
themselves: tests/gpu/test_mixed_chunk_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from kubesgl.engine import SamplingParams
from kubesgl.engine.executor.piecewise_graph import PiecewiseGraphRunner, default_token_counts

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"]


def test_token_counts_end_at_the_largest_step():
    assert default_token_counts(20) == [8, 16, 20]
    assert default_token_counts(1024)[-5:] == [512, 640, 768, 896, 1024]
    assert default_token_counts(5) == [5]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-chunk", "prefill"])
def test_piecewise_steps_give_transformers_greedy_tokens(
    arch, mixed, tiny_model, make_llm, hf_greedy, random_prompts
):
    path = tiny_model(arch)
    llm = make_llm(path, chunked_prefill_size=20, enable_mixed_chunk=mixed, max_running_requests=8)
    runner = llm.engine.executor.runner
    pieces = PiecewiseGraphRunner(
        llm.engine.model, llm.engine.executor.runner.kv_pool, 32
    )  # counts 8, 16, 32: 20 pads to 32
    modes, run = [], pieces.run

    def counted(input_ids, batch, backend):
        modes.append((batch.mode.name, batch.num_tokens))
        return run(input_ids, batch, backend)

    pieces.run = counted
    runner.piecewise_graphs = pieces
    prompts = random_prompts(6, 1, 90, seed=11)
    params = SamplingParams(max_tokens=16, temperature=0)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(path, prompt, params.max_tokens)
    assert {mode for mode, _ in modes} == ({"EXTEND", "MIXED"} if mixed else {"EXTEND"})
    assert any(n not in pieces.token_counts for _, n in modes)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-chunk", "prefill"])
def test_piecewise_steps_with_an_fp8_kv_cache_equal_whole_model_steps(
    mixed, tiny_model, make_llm, random_prompts
):
    """The KV store between pieces casts to FP8 as the whole model's does (FP8 KV is no longer
    transformers' greedy output, so the reference is the same engine without the pieces)."""
    prompts = random_prompts(6, 1, 90, seed=12)
    params = SamplingParams(max_tokens=16, temperature=0)

    def tokens(piecewise: bool) -> list[list[int]]:
        llm = make_llm(
            tiny_model("llama"),
            kv_cache_dtype="fp8_e4m3",
            chunked_prefill_size=20,
            enable_mixed_chunk=mixed,
            max_running_requests=8,
        )
        if piecewise:
            llm.engine.executor.runner.piecewise_graphs = PiecewiseGraphRunner(
                llm.engine.model, llm.engine.executor.runner.kv_pool, 32
            )
        return [out.token_ids for out in llm.generate(prompts, params)]

    assert tokens(piecewise=True) == tokens(piecewise=False)


def test_asking_for_piecewise_graphs_without_cuda_says_they_are_off(tiny_model, make_llm, caplog):
    with caplog.at_level("WARNING"):
        llm = make_llm(tiny_model("llama"), enable_piecewise_cuda_graph=True)
    assert llm.engine.executor.runner.piecewise_graphs is None
    assert "piecewise CUDA graphs off: no CUDA graphs on cpu" in caplog.text


def test_piecewise_graphs_with_cuda_graphs_disabled_is_refused():
    """The pair contradicts itself: the first was dropped with a warning. Asked for where there
    is no CUDA (the test above) they stay a no-op: the same options run on CPUs and GPUs."""
    from kubesgl.engine.config import EngineConfig

    config = EngineConfig(model="m", enable_piecewise_cuda_graph=True, disable_cuda_graph=True)
    with pytest.raises(
        ValueError, match="--enable-piecewise-cuda-graph: --disable-cuda-graph turns every"
    ):
        config.validate()


def test_pieces_store_the_kv_of_whole_model_steps_and_padding_only_in_the_padding_slot(
    tiny_model, make_llm, random_prompts
):
    """The pieces store each layer's K and V themselves, padding rows included: every slot but
    the padding slot (0) ends as the whole model leaves it."""
    prompts = random_prompts(6, 1, 90, seed=13)
    params = SamplingParams(max_tokens=8, temperature=0)

    def pool(piecewise: bool) -> list[torch.Tensor]:
        llm = make_llm(
            tiny_model("llama"),
            chunked_prefill_size=20,
            enable_mixed_chunk=True,
            max_running_requests=8,
        )
        runner = llm.engine.executor.runner
        if piecewise:
            pieces = PiecewiseGraphRunner(llm.engine.model, runner.kv_pool, 32)
            run = pieces.run
            pieces.run = lambda *args: padded.append(args[1].num_tokens) or run(*args)
            runner.piecewise_graphs = pieces
        llm.generate(prompts, params)
        return [t[1:].clone() for t in runner.kv_pool.k + runner.kv_pool.v]

    padded: list[int] = []  # token counts of the steps the pieces ran
    whole, pieces = pool(piecewise=False), pool(piecewise=True)
    assert any(n not in (8, 16, 32) for n in padded)  # some steps were padded
    assert any(t.abs().sum() > 0 for t in whole)
    for expected, stored in zip(whole, pieces):
        torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-5)
