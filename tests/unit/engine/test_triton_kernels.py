"""The Triton attention kernels against a plain torch reference. On a machine without a GPU
they run in Triton's interpreter (TRITON_INTERPRET=1), which executes the same kernel code."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine.attention.triton_kernels.decode import decode_attention  # noqa: E402
from kubesgl.engine.attention.triton_kernels.extend import extend_attention  # noqa: E402
from kubesgl.engine.attention.triton_kernels.kv_pages import gather_kv_pages  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE_ON_CPU = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the engine on the CPU through Triton's interpreter; tests/gpu runs these kernels on the GPU",
)


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


def test_gather_kv_pages_of_one_token_concatenates_each_rows_slots():
    table = torch.arange(5 * 1200, dtype=torch.int64).reshape(5, 1200).to(DEVICE)
    rows, lens = [3, 0, 4], [1, 1100, 513]  # lengths across the kernel's 512-page blocks
    got = gather_kv_pages(
        table, torch.tensor(rows, device=DEVICE), torch.tensor(lens, device=DEVICE), 1, sum(lens)
    )
    expected = torch.cat([table[r, :n] for r, n in zip(rows, lens)])
    assert got.dtype == torch.int32 and got.tolist() == expected.tolist()


def test_gather_kv_pages_lists_the_pages_of_each_rows_tokens():
    page, gen = 16, torch.Generator().manual_seed(0)
    table = torch.zeros(4, 9000, dtype=torch.int64)
    rows, lens = [2, 0, 3], [1, 16, 8193]  # a partial page, a full one, across 512-page blocks
    pages = {
        r: torch.randperm(2000, generator=gen)[: -(-n // page)] + 1 for r, n in zip(rows, lens)
    }
    for r, n in zip(rows, lens):  # a request's tokens fill its pages in order
        table[r, :n] = (pages[r][:, None] * page + torch.arange(page)).flatten()[:n]
    got = gather_kv_pages(
        table.to(DEVICE),
        torch.tensor(rows, device=DEVICE),
        torch.tensor(lens, device=DEVICE),
        page,
        sum(len(p) for p in pages.values()),
    )
    assert got.tolist() == torch.cat([pages[r] for r in rows]).tolist()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits", [4, 32, None])  # 32: most splits of a short KV empty
def test_decode_matches_reference(heads, kv_heads, window, num_splits):
    dim, seq_lens = 16, [1, 37, 90]
    k_cache, v_cache, table, rows = paged_setup(seq_lens, heads, kv_heads, dim, torch.float32)
    q = torch.randn(len(seq_lens), heads, dim, device=DEVICE)
    out = decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        torch.tensor(seq_lens, device=DEVICE),
        0.25,
        window,
        num_splits=num_splits,
    )
    for i, (row, n) in enumerate(zip(rows.tolist(), seq_lens)):
        slots = table[row, :n]
        ref = reference(
            q[i : i + 1],
            k_cache[slots],
            v_cache[slots],
            torch.tensor([n - 1], device=DEVICE),
            0.25,
            window,
        )
        torch.testing.assert_close(out[i], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_extend_with_cached_prefixes_matches_reference(window):
    heads, kv_heads, dim = 4, 2, 16
    seq_lens, extend_lens = [40, 5, 70], [40, 3, 33]  # no prefix, short new part, long prefix
    k_cache, v_cache, table, rows = paged_setup(
        seq_lens, heads, kv_heads, dim, torch.float32, seed=1
    )
    q = torch.randn(sum(extend_lens), heads, dim, device=DEVICE)
    lens = torch.tensor(extend_lens, device=DEVICE)
    out = extend_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        torch.tensor(seq_lens, device=DEVICE),
        lens,
        torch.cumsum(lens, 0) - lens,
        max(extend_lens),
        0.25,
        window,
    )
    start = 0
    for row, n, e in zip(rows.tolist(), seq_lens, extend_lens):
        slots = table[row, :n]
        q_pos = torch.arange(n - e, n, device=DEVICE)
        ref = reference(q[start : start + e], k_cache[slots], v_cache[slots], q_pos, 0.25, window)
        torch.testing.assert_close(out[start : start + e], ref, rtol=1e-5, atol=1e-5)
        start += e


@ENGINE_ON_CPU
def test_engine_with_triton_backend_equals_transformers(
    tiny_model, make_llm, hf_greedy, random_prompts
):
    path = tiny_model("qwen3")
    llm = make_llm(path, attention_backend="triton", page_size=4, chunked_prefill_size=32)
    from kubesgl.engine import SamplingParams

    first = random_prompts(3, 10, 50, seed=20)
    for prompts in (first, [p + [9, 9] for p in first]):  # the second round hits the prefix cache
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == hf_greedy(path, prompt, 6)


@ENGINE_ON_CPU
def test_engine_with_triton_backend_mixes_chunks_and_decodes(
    tiny_model, make_llm, long_prompt_while_decoding
):
    """A mixed step's prefill rows through the extend kernel, its decode rows through the
    decode kernel (tests/gpu runs the same on the GPU, with FlashInfer too)."""
    path = tiny_model("qwen3")
    llm = make_llm(
        path,
        attention_backend="triton",
        page_size=4,
        enable_mixed_chunk=True,
        chunked_prefill_size=24,
        max_running_requests=4,
    )
    long_prompt_while_decoding(llm, path, seed=22, max_tokens=6, long_len=40)


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (13, 2, 8), (40, 4, 6)])
def test_fused_moe_matches_the_expert_loop(tokens, top_k, experts):
    from kubesgl.engine.layers.moe import SparseMoeBlock

    torch.manual_seed(tokens)
    block = SparseMoeBlock(
        32,
        48,
        num_experts=experts,
        top_k=top_k,
        normalize_top_k=True,
        hidden_act="silu",
        dtype=torch.float32,
    ).to(DEVICE)
    for p in (block.gate.weight, block.w13, block.w2):
        p.data.normal_(std=0.3)
    x = torch.randn(tokens, 32, device=DEVICE)
    reference = block(x)
    block.fused = True
    torch.testing.assert_close(block(x), reference, rtol=1e-5, atol=1e-5)


def test_expert_alignment_groups_pairs_by_expert():
    from kubesgl.engine.layers.triton_kernels.fused_moe import align_to_experts

    experts = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    blocks = align_to_experts(experts, num_experts=4, block_m=4)
    pairs, block_experts = blocks.sorted_pairs.tolist(), blocks.block_experts.tolist()
    assert int(blocks.num_blocks) == 3  # experts 0, 1 and 2 each fill one padded block
    assert block_experts[:3] == [0, 1, 2]
    assert sorted(pairs[0:4]) == [1, 4, 6, 6] and sorted(pairs[4:8]) == [3, 6, 6, 6]
    assert sorted(pairs[8:12]) == [0, 2, 5, 6]  # 6 = number of pairs: padding


@ENGINE_ON_CPU
def test_engine_with_fused_moe_equals_transformers(tiny_model, make_llm, hf_greedy, random_prompts):
    from kubesgl.engine import SamplingParams
    from kubesgl.engine.layers.moe import SparseMoeBlock

    path = tiny_model("qwen3-moe")
    llm = make_llm(path, attention_backend="triton")
    for module in llm.engine.model.modules():
        if isinstance(module, SparseMoeBlock):
            module.fused = True
    prompts = random_prompts(3, 5, 40, seed=21)
    for prompt, out in zip(
        prompts, llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    ):
        assert out.token_ids == hf_greedy(path, prompt, 6)


def test_decode_splits_fill_the_device_and_stay_a_power_of_two(monkeypatch):
    """A batch of one is split enough to occupy every multiprocessor; larger batches keep 8
    splits; the merge kernel needs a power of two."""
    import kubesgl.engine.attention.triton_kernels.decode as decode

    monkeypatch.setattr(decode, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    kv_heads = 8
    splits = {b: decode.default_num_splits(b * kv_heads, cuda) for b in (1, 2, 3, 4, 8, 256)}
    assert splits == {1: 32, 2: 16, 3: 16, 4: 8, 8: 8, 256: 8}  # 3: 11 rounded up
    assert decode.default_num_splits(8, torch.device("cpu")) == 8
