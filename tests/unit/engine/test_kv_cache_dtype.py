"""`--kv-cache-dtype fp8_e4m3`: the pool stores K and V in FP8 (half the bytes per token, so
twice the tokens in the same memory) and every backend reads them back widened to the
model's dtype: attention over an FP8 pool equals attention over a pool that holds the same
values in the model's dtype."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine.attention import AttentionLayerSpec, create_backend  # noqa: E402
from kubesgl.engine.config import EngineConfig  # noqa: E402
from kubesgl.engine.forward_batch import ForwardMode  # noqa: E402
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable  # noqa: E402
from kubesgl.engine.kvcache.store_kv import store_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


def test_fp8_halves_the_bytes_of_a_token():
    assert KVPool.bytes_per_slot(32, 8, 128, FP8) * 2 == KVPool.bytes_per_slot(
        32, 8, 128, torch.bfloat16
    )


def test_write_stores_the_fp8_rounding_and_saturates():
    pool = KVPool(16, 1, 2, 4, FP8, torch.device("cpu"), compute_dtype=torch.float32)
    k = torch.tensor([[[0.3, -1000.0, 7.1, 1e-3]] * 2] * 3)
    pool.write(0, torch.tensor([1, 5, 9]), k, -k)
    # the largest FP8 e4m3 value, not NaN (what a plain cast gives in some torch releases)
    assert torch.equal(pool.k[0][[1, 5, 9]].float(), k.clamp(-448, 448).to(FP8).float())
    assert pool.k[0][1, 0, 1].float().item() == -448.0
    assert torch.equal(pool.v[0][5].float(), (-k[1]).clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_store_kv_kernel_equals_indexed_writes(cache_dtype):
    gen = torch.Generator().manual_seed(0)
    qkv = (
        torch.randn(5, 3 * 2 * 8, generator=gen) * 300
    )  # k and v are strided views, as in the model
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, 0, 9, 4, 12])
    k_cache, v_cache = (
        torch.zeros(16, 2, 8, dtype=cache_dtype),
        torch.zeros(16, 2, 8, dtype=cache_dtype),
    )
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(got_k, got_v, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    limit = 448.0 if cache_dtype == FP8 else float("inf")  # FP8: clamped to its range, never NaN
    k_cache[slots], v_cache[slots] = (
        k.clamp(-limit, limit).to(cache_dtype),
        v.clamp(-limit, limit).to(cache_dtype),
    )
    assert not got_k.float().isnan().any()
    assert torch.equal(got_k.cpu().float(), k_cache.float()) and torch.equal(
        got_v.cpu().float(), v_cache.float()
    )


@pytest.mark.parametrize("path", ["kernel", "indexed"])
def test_fp8_writes_keep_nan_and_clamp_infinities(path):
    special = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 460.0, -3.0, 0.0, 1e-9, 448.0]
    )
    k = special.view(1, 2, 4).to(DEVICE)
    if path == "kernel":
        k_cache, v_cache = (torch.zeros(4, 2, 4, dtype=FP8, device=DEVICE) for _ in range(2))
        store_kv(k_cache, v_cache, torch.tensor([2], device=DEVICE), k, k)
        got = k_cache[2].flatten().float().cpu()
    else:
        pool = KVPool(4, 1, 2, 4, FP8, torch.device("cpu"), compute_dtype=torch.float32)
        pool.write(0, torch.tensor([2]), k.cpu(), k.cpu())
        got = pool.k[0][2].flatten().float()
    if (
        path == "indexed" or DEVICE.type == "cuda"
    ):  # the interpreter's own FP8 conversion makes NaN finite
        assert got[0].isnan()  # a NaN is not hidden as a plausible value
    assert got[1:4].tolist() == [448.0, -448.0, 448.0]
    assert got[4:].tolist() == special[4:].to(FP8).float().tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_attention_over_fp8_equals_attention_over_its_values(backend, mode, attention_batch):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16
    spec = [AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5, None)]
    table = ReqToTokenTable(4, 64, DEVICE)
    table.table.copy_((torch.randperm(511, generator=gen)[:256] + 1).view(4, 64))  # scattered slots
    seq_lens, rows = [40, 7, 23], [2, 0, 3]
    extend_lens = [1, 1, 1] if mode is ForwardMode.DECODE else [40, 3, 10]
    batch = attention_batch(mode, seq_lens, extend_lens, rows, table.table)
    total = sum(extend_lens)
    q, k, v = (
        torch.randn(total, h, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads)
    )
    outputs = []
    for cache_dtype in (FP8, torch.float32):
        pool = KVPool(512, 1, kv_heads, dim, cache_dtype, DEVICE, compute_dtype=torch.float32)
        values = (
            torch.randn(2, 512, kv_heads, dim, generator=torch.Generator().manual_seed(2))
            .mul(4)
            .to(FP8)
        )
        pool.k[0].copy_(values[0].to(cache_dtype))
        pool.v[0].copy_(values[1].to(cache_dtype))
        attention = create_backend(backend, kv_pool=pool, req_to_token=table, layers=spec)
        attention.prepare(batch)
        # the step's own k and v are written first: in FP8 for one pool, rounded alike for the other
        step_k, step_v = (k, v) if cache_dtype == FP8 else (k.to(FP8).float(), v.to(FP8).float())
        outputs.append(attention.forward(q, step_k, step_v, spec[0], batch))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="--kv-cache-dtype must be auto or fp8_e4m3"):
        EngineConfig(model="m", kv_cache_dtype="int4").validate()


def test_engine_with_an_fp8_cache_holds_more_tokens_in_the_same_memory(tiny_model, monkeypatch):
    from kubesgl.engine import LLM, SamplingParams
    from kubesgl.engine.scheduler import engine

    # the same free memory for both engines: 1 GiB of which 15% is held back
    monkeypatch.setattr(engine, "_available_memory", lambda device: (2**30, 2**30))
    path = tiny_model("llama")
    pools = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        with LLM(
            path,
            dtype="bfloat16",
            device="cpu",
            kv_cache_dtype=kv_dtype,
            max_running_requests=4096,
            context_length=2048,
        ) as llm:
            out = llm.generate(
                [[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            )
            assert all(len(o.token_ids) == 8 for o in out)
            pool = llm.engine.executor.runner.kv_pool
            pools[kv_dtype] = (pool.dtype, pool.num_slots)
            llm.engine.scheduler.drain()
            llm.engine.scheduler.check_integrity()
    assert pools["auto"][0] == torch.bfloat16 and pools["fp8_e4m3"][0] == FP8
    assert (
        abs(pools["fp8_e4m3"][1] - 2 * pools["auto"][1]) <= 2
    )  # twice the slots, but for rounding
