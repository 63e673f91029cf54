"""The FlashInfer backend on the GPU: its attention (and the Triton backend's) against the
torch backend's on the same paged pool (prefixes, sliding windows, grouped heads, an FP8
pool, pages of one and of 16 tokens), CUDA-graph replays against eager steps, and whole
generations against the torch backend. FlashInfer computes in float16 or
bfloat16 only, so generations are compared with rounding in mind: they must agree until a
step where the reference's two best tokens are a near tie."""

from __future__ import annotations

import random

import pytest
import torch

from kubesgl.engine import LLM, SamplingParams
from kubesgl.engine.attention import AttentionLayerSpec, create_backend
from kubesgl.engine.forward_batch import ForwardMode
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable

pytestmark = pytest.mark.gpu
pytest.importorskip(
    "flashinfer", reason="FlashInfer is not installed here: pip install 'kubesgl[flashinfer]'"
)


@pytest.mark.parametrize(
    "dtype,kv_dtype,head_dim,window",
    [
        (torch.float16, torch.float16, 64, None),
        (torch.float16, torch.float16, 64, 37),
        (torch.bfloat16, torch.bfloat16, 128, None),
        (torch.bfloat16, torch.bfloat16, 128, 37),
        (torch.bfloat16, torch.float8_e4m3fn, 128, None),  # --kv-cache-dtype fp8_e4m3
    ],
)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_matches_torch_backend(
    backend, dtype, kv_dtype, head_dim, window, mode, page_size, attention_batch
):
    device = torch.device("cuda")
    heads, kv_heads, layers = 8, 2, 2
    pool = KVPool(
        16384,
        layers,
        kv_heads,
        head_dim,
        kv_dtype,
        device,
        compute_dtype=dtype,
        page_size=page_size,
    )
    table = ReqToTokenTable(8, 1024, device)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    # scattered pages (page 0 is the padding page), each filled in order by its request
    pages = torch.randperm(16384 // page_size - 1, generator=gen)[: 8 * 1024 // page_size] + 1
    table.table.copy_((pages[:, None] * page_size + torch.arange(page_size)).view(8, 1024))
    specs = [
        AttentionLayerSpec(i, heads, kv_heads, head_dim, head_dim**-0.5, window if i else None)
        for i in range(layers)
    ]
    seq_lens, rows = [300, 1, 77, 1000], [5, 0, 3, 7]
    extend_lens = (
        [1] * 4 if mode is ForwardMode.DECODE else [300, 1, 20, 129]
    )  # whole prompts and cached prefixes
    batch = attention_batch(mode, seq_lens, extend_lens, rows, table.table)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    outputs = {}
    for name in ("torch", backend):
        attention = create_backend(name, kv_pool=pool, req_to_token=table, layers=specs)
        attention.prepare(batch)
        outputs[name] = [attention.forward(q, k, v, spec, batch).float() for spec in specs]
    for ref, got in zip(outputs["torch"], outputs[backend]):
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def agreed_until_near_tie(reference, candidate, tie: float = 0.05) -> bool:
    """True if the two greedy runs agree token for token; False if they part where the
    reference's best two tokens were within `tie` nats (rounding may pick either); any
    other difference fails."""
    for step, (a, b) in enumerate(zip(reference.token_ids, candidate.token_ids)):
        if a != b:
            (_, first), (_, second) = sorted(reference.logprobs[step].top, key=lambda t: -t[1])[:2]
            assert first - second < tie, (
                f"step {step}: {a} != {b} with a margin of {first - second:.3f}"
            )
            return False
    assert len(reference.token_ids) == len(candidate.token_ids)
    return True


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
def test_flashinfer_generations_equal_torch_backend(arch, tiny_model):
    path = tiny_model(arch, head_dim=64)
    rng = random.Random(3)
    batch = [[rng.randrange(3, 600) for _ in range(rng.randint(1, 150))] for _ in range(12)]
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=2)
    common = dict(
        device="cuda",
        dtype="float16",
        page_size=16,
        max_total_tokens=16384,
        max_running_requests=16,
    )
    with LLM(path, attention_backend="torch", **common) as reference:
        expected = reference.generate(batch, params)
    for cuda_graph in (True, False):
        with LLM(
            path, attention_backend="flashinfer", disable_cuda_graph=not cuda_graph, **common
        ) as llm:
            assert (llm.engine.executor.runner.cuda_graphs is not None) == cuda_graph
            got = llm.generate(batch, params)
            again = llm.generate(batch, params)  # served from the prefix cache
            llm.engine.scheduler.drain()
            llm.engine.scheduler.check_integrity()
        same = [agreed_until_near_tie(ref, out) for ref, out in zip(expected, got)]
        assert sum(same) >= len(batch) - 2, same
        # cached prefixes take another kernel path than whole prompts: the same rule applies
        same = [agreed_until_near_tie(out, cached) for out, cached in zip(got, again)]
        assert sum(same) >= len(batch) - 2, same
