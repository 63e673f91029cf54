"""The engine on a CUDA device through the same code as on the CPU (torch attention
backend): greedy tokens equal transformers' on the GPU in float32, overlap on and off."""

from __future__ import annotations

import random

import pytest
import torch

from kubesgl.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"]


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 600) for _ in range(rng.randint(1, 120))] for _ in range(count)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers_on_cuda(arch, overlap, page_size, tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    batch = prompts(6, seed=len(arch))
    with LLM(
        path,
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        page_size=page_size,
        chunked_prefill_size=48,
        disable_overlap_schedule=not overlap,
        max_total_tokens=8192,
    ) as llm:
        outputs = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0))
        # the same prompts again: now served from the radix cache
        again = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0))
        scheduler = llm.engine.scheduler
        scheduler.drain()
        scheduler.check_integrity()
    for prompt, out, cached in zip(batch, outputs, again):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()
        assert cached.token_ids == out.token_ids


def test_sampling_with_every_option_on_cuda(tiny_model):
    with LLM(tiny_model("qwen3"), device="cuda", dtype="bfloat16", max_total_tokens=8192) as llm:
        params = [
            SamplingParams(
                max_tokens=20,
                temperature=0.9,
                top_k=20,
                top_p=0.9,
                min_p=0.05,
                seed=s,
                repetition_penalty=1.2,
                frequency_penalty=0.3,
                presence_penalty=0.3,
                ignore_eos=True,
                logprobs=3,
            )
            for s in range(16)
        ]
        first = llm.generate(prompts(16, seed=1), params)
        second = llm.generate(prompts(16, seed=1), params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 20 and len(o.logprobs) == 20 for o in first)


def test_min_tokens_on_cuda_with_graphs(tiny_model):
    """The tokens that would end a request are banned on the device, in graph-replayed decode
    steps too: greedy runs that end at their second token go on to min_tokens."""
    batch = prompts(8, seed=3)
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(tiny_model("llama"), device="cuda", dtype="bfloat16", max_total_tokens=8192) as llm:
        reference = llm.generate(batch, SamplingParams(**greedy))
        stops = [ref.token_ids[1] for ref in reference]
        held = llm.generate(
            batch, [SamplingParams(**greedy, stop_token_ids=[t], min_tokens=6) for t in stops]
        )
    for out, stop in zip(held, stops):
        assert len(out.token_ids) >= 6 and stop not in out.token_ids[:6], out.token_ids


def test_logit_bias_on_cuda_with_graphs(tiny_model):
    """A logit_bias applies to the logits on the device, in graph-replayed decode steps too:
    +100 forces its token at every step of a sampled request, beside one without a bias."""
    batch = prompts(2, seed=4)
    with LLM(tiny_model("llama"), device="cuda", dtype="bfloat16", max_total_tokens=8192) as llm:
        forced, plain = llm.generate(
            batch,
            [
                SamplingParams(max_tokens=8, temperature=1.0, seed=1, logit_bias={7: 100}),
                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            ],
        )
    assert forced.token_ids == [7] * 8
    assert len(plain.token_ids) == 8


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_retraction_storm_on_cuda_returns_what_a_large_pool_returns(backend, tiny_model):
    """Retracted requests resume exactly with CUDA graphs and overlap on, for each backend:
    24 greedy requests on a pool that holds one or two of them whole, the estimate pinned at
    its most optimistic so that retractions come one after another."""
    from kubesgl.engine.scheduler.admission import OutputEstimate

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    path, batch = (
        tiny_model("llama", head_dim=64),
        prompts(24, seed=5),
    )  # FlashInfer needs 64, 128 or 256
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    common = dict(
        device="cuda",
        dtype="float32" if backend != "flashinfer" else "float16",
        attention_backend=backend,
        page_size=16,
    )
    with LLM(path, max_total_tokens=16384, **common) as llm:
        reference = llm.generate(batch, params)
    with LLM(path, max_total_tokens=256, **common) as llm:
        scheduler = llm.engine.scheduler
        scheduler.kv.estimate = OutputEstimate(ratio=0.05, weight=0.0, backoff=1.0)
        outputs = llm.generate(batch, params)
        assert scheduler.stats().retractions >= 5
        scheduler.drain()
        scheduler.check_integrity()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
