"""The Triton attention kernels against a plain torch reference. On a machine without a GPU
they run in Triton's interpreter (TRITON_INTERPRET=1), which executes the same kernel code."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

pytest.importorskip("triton")

from kubesgl.engine.attention.triton_kernels.decode import decode_attention  # noqa: E402
from kubesgl.engine.attention.triton_kernels.extend import extend_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, q_pos, scale, window):
    """q: [n, heads, dim] at positions q_pos; k, v: [len, kv_heads, dim] for positions 0..len-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    allowed = key_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def paged_setup(seq_lens, heads, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens) + 64
    k_cache = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    perm = torch.randperm(total - 1, generator=gen) + 1  # scattered slots, slot 0 unused
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 8, dtype=torch.int64)
    rows = torch.tensor([2, 0, 3, 1][: len(seq_lens)])
    start = 0
    for row, n in zip(rows.tolist(), seq_lens):
        table[row, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, table.to(DEVICE), rows.to(DEVICE)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_reference(heads, kv_heads, window):
    dim, seq_lens = 16, [1, 37, 90]
    k_cache, v_cache, table, rows = paged_setup(seq_lens, heads, kv_heads, dim, torch.float32)
    q = torch.randn(len(seq_lens), heads, dim, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, table, rows, torch.tensor(seq_lens, device=DEVICE), 0.25, window,
                           num_splits=4)
    for i, (row, n) in enumerate(zip(rows.tolist(), seq_lens)):
        slots = table[row, :n]
        ref = reference(q[i : i + 1], k_cache[slots], v_cache[slots], torch.tensor([n - 1], device=DEVICE), 0.25, window)
        torch.testing.assert_close(out[i], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_extend_with_cached_prefixes_matches_reference(window):
    heads, kv_heads, dim = 4, 2, 16
    seq_lens, extend_lens = [40, 5, 70], [40, 3, 33]  # no prefix, short new part, long prefix
    k_cache, v_cache, table, rows = paged_setup(seq_lens, heads, kv_heads, dim, torch.float32, seed=1)
    q = torch.randn(sum(extend_lens), heads, dim, device=DEVICE)
    lens = torch.tensor(extend_lens, device=DEVICE)
    out = extend_attention(q, k_cache, v_cache, table, rows, torch.tensor(seq_lens, device=DEVICE), lens,
                           torch.cumsum(lens, 0) - lens, max(extend_lens), 0.25, window)
    start = 0
    for row, n, e in zip(rows.tolist(), seq_lens, extend_lens):
        slots = table[row, :n]
        q_pos = torch.arange(n - e, n, device=DEVICE)
        ref = reference(q[start : start + e], k_cache[slots], v_cache[slots], q_pos, 0.25, window)
        torch.testing.assert_close(out[start : start + e], ref, rtol=1e-5, atol=1e-5)
        start += e


def test_engine_with_triton_backend_equals_transformers(tiny_model, make_llm, hf_greedy, random_prompts):
    path = tiny_model("qwen3")
    llm = make_llm(path, attention_backend="triton", page_size=4, chunked_prefill_size=32)
    from kubesgl.engine import SamplingParams

    first = random_prompts(3, 10, 50, seed=20)
    for prompts in (first, [p + [9, 9] for p in first]):  # the second round hits the prefix cache
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == hf_greedy(path, prompt, 6)
