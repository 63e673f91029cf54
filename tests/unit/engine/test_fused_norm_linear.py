"""The norm fused into qkv_proj and gate_up_proj (layers/norm_linear.py, off by default),
turned on in a whole engine: greedy tokens still equal transformers'. Without a GPU the
kernel runs in Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine import SamplingParams  # noqa: E402
from kubesgl.engine.layers import norm_linear  # noqa: E402
from kubesgl.engine.layers.triton_kernels import norm_gemv  # noqa: E402


@pytest.fixture
def fused_calls(monkeypatch):
    """Turns the fusion on for the test (with PDL, which falls back where the device lacks
    it) and counts the fused kernel's calls by row count."""
    rows: list[int] = []
    kernel = norm_gemv.rms_norm_linear

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(norm_gemv, "rms_norm_linear", counted)
    norm_linear.enable_fused_norm_linear(norm_linear.FusedNormLinear(pdl=True))
    yield rows
    norm_linear.enable_fused_norm_linear(None)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3-moe"])  # qwen2: qkv bias; qwen3-moe: no dense MLP
def test_greedy_tokens_equal_transformers_with_the_norm_fused(arch, fused_calls, tiny_model, make_llm, hf_greedy,
                                                              random_prompts):
    path = tiny_model(arch)
    llm = make_llm(path, device="cuda" if torch.cuda.is_available() else "cpu")
    # the prefill step (47 tokens) takes the unfused pair, the decode steps (3 rows) the fused kernel
    prompts = [random_prompts(1, 5, 5, seed=1)[0], random_prompts(1, 12, 12, seed=2)[0],
               random_prompts(1, 30, 30, seed=3)[0]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(path, prompt, 6), f"prompt of {len(prompt)} tokens"
    assert fused_calls and max(fused_calls) <= norm_gemv.MAX_ROWS
    assert 3 in fused_calls  # the decode steps of all three requests
