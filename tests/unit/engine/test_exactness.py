"""Greedy tokens equal transformers' greedy generate, token for token (float32, CPU)."""

from __future__ import annotations

import pytest

from kubesgl.engine import SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _check(llm, path, prompts, hf_greedy, params=GREEDY):
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(path, prompt, params.max_tokens), (
            f"prompt of {len(prompt)} tokens"
        )
    return outputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_mixed_lengths_in_one_batch(arch, overlap, tiny_model, make_llm, hf_greedy, random_prompts):
    path = tiny_model(arch)
    llm = make_llm(path, disable_overlap_schedule=not overlap)
    _check(llm, path, random_prompts(6, 1, 90, seed=1), hf_greedy)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefixes_hit_the_radix_cache(
    arch, page_size, tiny_model, make_llm, hf_greedy, random_prompts
):
    path = tiny_model(arch)
    llm = make_llm(path, page_size=page_size)
    # 100 shared tokens: with page size 16 the cached prefix ends inside a page (at 96).
    shared = random_prompts(1, 100, 100, seed=2)[0]
    first = _check(llm, path, [shared + [7, 8, 9]], hf_greedy)
    assert first[0].cached_tokens == 0
    questions = random_prompts(5, 1, 30, seed=3)
    outputs = _check(llm, path, [shared + q for q in questions], hf_greedy)
    expected_hit = 100 if page_size == 1 else 96
    assert [o.cached_tokens for o in outputs] == [expected_hit] * len(questions)


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_chunked_prefill_with_small_chunks(
    arch, page_size, overlap, tiny_model, make_llm, hf_greedy, random_prompts
):
    path = tiny_model(arch)
    llm = make_llm(
        path, page_size=page_size, chunked_prefill_size=24, disable_overlap_schedule=not overlap
    )
    _check(llm, path, random_prompts(4, 50, 130, seed=4), hf_greedy)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_retracted_requests_resume_exactly(
    arch, overlap, tiny_model, make_llm, hf_greedy, random_prompts
):
    """A pool that holds two of these requests whole: optimistic admission takes more, and
    retracted requests later resume (prefilling their outputs) with the same greedy tokens."""
    path = tiny_model(arch)
    params = SamplingParams(max_tokens=40, temperature=0)
    llm = make_llm(path, max_total_tokens=160, disable_overlap_schedule=not overlap)
    _check(llm, path, random_prompts(6, 20, 40, seed=9), hf_greedy, params)
    assert llm.engine.scheduler.stats().retractions > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_retracted_requests_resume_exactly_in_small_chunks_and_pages(
    arch, tiny_model, make_llm, hf_greedy, random_prompts
):
    """Resumption prefills prompt and outputs in several chunks, and the cached prefix ends
    inside a page (page size 16)."""
    path = tiny_model(arch)
    params = SamplingParams(max_tokens=40, temperature=0)
    llm = make_llm(path, max_total_tokens=192, page_size=16, chunked_prefill_size=24)
    _check(llm, path, random_prompts(6, 20, 40, seed=10), hf_greedy, params)
    assert llm.engine.scheduler.stats().retractions > 0


def test_checkpoint_saved_by_transformers_sharded(tmp_path, make_llm, hf_greedy, random_prompts):
    """A checkpoint written by transformers' save_pretrained, sharded with an index file."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=1,
    )
    model = Qwen2ForCausalLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    path = str(tmp_path)
    llm = make_llm(path)
    _check(llm, path, random_prompts(4, 1, 60, vocab=300, seed=5), hf_greedy)


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["llama3", "yarn", "linear"],
)
def test_rope_scaling_variants(rope, tmp_path, tiny_model, make_llm, hf_greedy, random_prompts):
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"rope_theta": config["rope_theta"], **rope}
    (path / "config.json").write_text(json.dumps(config))
    llm = make_llm(str(path))
    _check(llm, str(path), random_prompts(3, 60, 150, seed=6), hf_greedy)


@pytest.mark.parametrize(
    "overlap,mixed",
    [(True, False), (False, False), (True, True)],
    ids=["overlap", "no-overlap", "mixed-chunk"],
)
def test_mistral_sliding_window(
    overlap, mixed, tmp_path, tiny_model, make_llm, hf_greedy, random_prompts
):
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_model("mistral"), path)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 16  # much shorter than the prompts: the window really cuts
    (path / "config.json").write_text(json.dumps(config))
    llm = make_llm(
        str(path),
        chunked_prefill_size=20,
        disable_overlap_schedule=not overlap,
        enable_mixed_chunk=mixed,
        max_running_requests=8,
    )
    _check(llm, str(path), random_prompts(3, 40, 70, seed=7), hf_greedy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(dtype, tiny_model, make_llm, random_prompts):
    import torch

    path = tiny_model("qwen3")
    llm = make_llm(path, dtype=dtype)
    assert {p.dtype for p in llm.engine.model.parameters()} == {getattr(torch, dtype)}
    prompts = random_prompts(4, 5, 40, seed=8)
    half = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    full = make_llm(path).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert all(len(o.token_ids) == 8 for o in half)
    # rounding may flip a near tie later on, but the first token of most prompts agrees
    assert sum(h.token_ids[0] == f.token_ids[0] for h, f in zip(half, full)) >= 3


def test_kv_pool_sized_from_memory(tiny_model):
    import torch

    from kubesgl.engine.config import EngineConfig
    from kubesgl.engine.model_config import load_model_config
    from kubesgl.engine.scheduler.engine import kv_pool_tokens

    model_config = load_model_config(tiny_model("llama"))
    config = EngineConfig(model="", max_running_requests=4)
    # capped by what the running requests can use: 4 requests x the context length
    assert (
        kv_pool_tokens(config, model_config, torch.float32, torch.device("cpu"), 2, 2048)
        == 4 * 2048
    )
    config.mem_fraction_static = 1e-9
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        kv_pool_tokens(config, model_config, torch.float32, torch.device("cpu"), 2, 2048)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "page_size,overlap", [(1, True), (16, False)], ids=["page1-overlap", "page16-no-overlap"]
)
def test_mixed_chunk_long_prompt_arrives_while_others_decode(
    arch, page_size, overlap, tiny_model, make_llm, long_prompt_while_decoding
):
    path = tiny_model(arch)
    llm = make_llm(
        path,
        enable_mixed_chunk=True,
        chunked_prefill_size=32,
        max_running_requests=8,
        page_size=page_size,
        disable_overlap_schedule=not overlap,
    )
    long_prompt_while_decoding(llm, path, seed=30)


def test_mixed_chunk_with_prompts_of_many_lengths(tiny_model, make_llm, hf_greedy, random_prompts):
    """All prompts at once, in chunks smaller than most: those done first decode beside the rest.
    (The prompts of test_mixed_lengths_in_one_batch, whose transformers outputs are cached.)"""
    path = tiny_model("qwen3-moe")
    llm = make_llm(path, enable_mixed_chunk=True, chunked_prefill_size=24, max_running_requests=8)
    _check(llm, path, random_prompts(6, 1, 90, seed=1), hf_greedy)


def test_mixed_chunk_logprobs_equal_separate_steps(
    tiny_model, make_llm, long_prompt_while_decoding
):
    path = tiny_model("llama")
    options = dict(chunked_prefill_size=32, max_running_requests=8)
    modes, mixed = long_prompt_while_decoding(
        make_llm(path, enable_mixed_chunk=True, **options), path, seed=32
    )
    modes_off, separate = long_prompt_while_decoding(make_llm(path, **options), path, seed=32)
    assert "MIXED" in modes and "MIXED" not in modes_off
    assert [lp.token_id for lp in mixed] == [lp.token_id for lp in separate]
    for a, b in zip(mixed, separate):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [x for _, x in a.top] == pytest.approx([x for _, x in b.top], abs=1e-5)


def test_mixed_chunk_needs_a_step_budget_above_the_running_requests(tiny_model):
    from kubesgl.engine import LLM

    with pytest.raises(
        ValueError,
        match=r"--chunked-prefill-size \(64\) must be larger than --max-running-requests",
    ):
        LLM(
            tiny_model("llama"),
            device="cpu",
            enable_mixed_chunk=True,
            chunked_prefill_size=64,
            max_running_requests=64,
        )


def test_a_prompt_chunk_asking_top_logprobs_beside_rows_asking_none(tiny_model, make_llm):
    """The rows that emit a token in a step ask logprobs=0, so the step samples no top
    logprobs; a chunk of a longer prompt in the same step that asks for the top 5 emits nothing
    and must not read them. The scheduler read them (TypeError on result.top_ids, None), and its
    process died with every request of the engine."""
    from kubesgl.engine import SamplingParams

    llm = make_llm(tiny_model("llama"), chunked_prefill_size=64)
    short, long = [5, 6, 7], list(range(10, 310))  # the long prompt takes five chunks
    outputs = llm.generate(
        [short, long],
        [
            SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0),
            SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5),
        ],
    )
    assert [len(out.logprobs) for out in outputs] == [4, 4]
    assert [len(lp.top) for out in outputs for lp in out.logprobs] == [0] * 4 + [5] * 4
