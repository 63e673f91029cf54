"""MixedAttention: a mixed step's prefill rows through a backend's extend path and its decode
rows through its decode path give what one extend pass over all rows gives (the torch
backend's, the reference). On the CPU the Triton kernels run in Triton's interpreter;
tests/gpu/test_mixed_chunk_cuda.py runs the same with FlashInfer and Triton on a GPU."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine.attention import AttentionLayerSpec, create_backend  # noqa: E402
from kubesgl.engine.attention.mixed import MixedAttention  # noqa: E402
from kubesgl.engine.forward_batch import ForwardMode  # noqa: E402
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable  # noqa: E402


@pytest.mark.parametrize("one_pass", [False, True], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("backend,window", [("torch", None), ("torch", 7), ("triton", 7)])
def test_mixed_attention_equals_one_extend_pass(backend, window, one_pass, attention_batch):
    """Split into an extend and a decode batch, or (where the backend asks for it) attended
    whole as one extend batch."""
    heads, kv_heads, head_dim = 4, 2, 16
    pool = KVPool(1024, 1, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    table = ReqToTokenTable(6, 128, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    table.table.copy_(
        (torch.randperm(1023, generator=gen)[: 6 * 128] + 1).view(6, 128)
    )  # scattered slots
    spec = [AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5, window)]
    # a whole prompt, a chunk after a cached prefix, then three decodes
    seq_lens, extend_lens, rows = [40, 50, 1, 90, 17], [40, 12, 1, 1, 1], [4, 0, 3, 1, 5]
    batch = dataclasses.replace(
        attention_batch(ForwardMode.MIXED, seq_lens, extend_lens, rows, table.table), prefill_rows=2
    )
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen)
    k = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen)
    reference = create_backend("torch", kv_pool=pool, req_to_token=table, layers=spec)
    reference.prepare(batch)  # a MIXED batch is an extend batch to a backend that is given it whole
    expected = reference.forward(q, k, v, spec[0], batch)
    attention = create_backend(backend, kv_pool=pool, req_to_token=table, layers=spec)
    attention.attends_mixed_in_one_pass = lambda batch: one_pass  # type: ignore[method-assign]
    mixed = MixedAttention(attention)
    mixed.prepare(batch)
    extend, decode = batch.attn.extend, batch.attn.decode
    if one_pass:
        assert (extend.mode, extend.batch_size, decode) == (ForwardMode.EXTEND, 5, None)
    else:
        assert (extend.mode, extend.batch_size, decode.mode, decode.batch_size) == (
            ForwardMode.EXTEND,
            2,
            ForwardMode.DECODE,
            3,
        )
    torch.testing.assert_close(
        mixed.forward(q, k, v, spec[0], batch), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED])
def test_attention_writes_into_the_output_it_is_given(backend, mode, attention_batch):
    """The piecewise graphs hand attention their fixed output buffer: what lands there must be
    the reference's attention, also when q, k and v are strided views of one fused projection."""
    heads, kv_heads, head_dim = 4, 2, 16
    pool = KVPool(256, 1, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    table.table.copy_(torch.arange(1, 257).view(4, 64))
    gen = torch.Generator().manual_seed(1)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))  # the requests' cached prefixes
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    spec = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5, None)
    extend_lens = [1, 1, 1] if mode is ForwardMode.DECODE else [20, 9, 1]
    batch = attention_batch(mode, [30, 9, 12], extend_lens, [2, 0, 1], table.table)
    if mode is ForwardMode.MIXED:
        batch = dataclasses.replace(batch, prefill_rows=2)
    qkv = torch.randn(sum(extend_lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = spec.split_qkv(qkv)  # strided views, as Attention.project gives them
    assert not q.is_contiguous()
    reference = create_backend("torch", kv_pool=pool, req_to_token=table, layers=[spec])
    whole = dataclasses.replace(batch)  # a MIXED batch is one extend batch to the reference
    reference.prepare(whole)
    expected = reference.forward(q.contiguous(), k.contiguous(), v.contiguous(), spec, whole)
    attention = create_backend(backend, kv_pool=pool, req_to_token=table, layers=[spec])
    if mode is ForwardMode.MIXED:
        attention = MixedAttention(attention)
    attention.prepare(batch)
    out = attention.forward(q, k, v, spec, batch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    given = torch.full_like(out, float("nan"))  # piecewise graphs pass their own buffer
    attention.attend(q, spec, batch, given)
    torch.testing.assert_close(given, out, rtol=0, atol=0)
