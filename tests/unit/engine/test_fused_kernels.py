"""The fused Triton kernels of the layers (RMS norm with the residual add, rotary
embedding, silu-and-mul) against the torch expressions they replace on CUDA. Without a GPU
they run in Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine.layers.norm import RMSNorm  # noqa: E402
from kubesgl.engine.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402
from kubesgl.engine.layers.triton_kernels.activation import silu_and_mul  # noqa: E402
from kubesgl.engine.layers.triton_kernels.norm import rms_norm  # noqa: E402
from kubesgl.engine.layers.triton_kernels.rotary import apply_rotary_inplace  # noqa: E402
from kubesgl.engine.model_config import RopeConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype):
    """float32: sums run in another order than torch's. bfloat16: a rounding step or two of
    values up to about 4 (Triton's interpreter also rounds to bfloat16 its own way); a wrong
    index or formula is off by whole units."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 100])
def test_rms_norm_with_and_without_residual(dtype, size):
    gen = torch.Generator().manual_seed(size)
    norm = RMSNorm(size, 1e-6, dtype)
    norm.weight.copy_(torch.rand(size, generator=gen) + 0.5)
    x = (torch.randn(5, size, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, size, generator=gen).to(dtype)
    weight = norm.weight.to(DEVICE)
    torch.testing.assert_close(
        rms_norm(x.to(DEVICE), weight, 1e-6).cpu(), norm(x), **tolerance(dtype)
    )
    normed, summed = rms_norm(x.to(DEVICE), weight, 1e-6, residual.to(DEVICE))
    ref_normed, ref_summed = norm(x, residual)
    if DEVICE == "cuda":
        assert torch.equal(summed.cpu(), ref_summed)  # the residual stream itself is exact
    else:  # the interpreter truncates to bfloat16 where the GPU rounds to nearest
        torch.testing.assert_close(summed, ref_summed, **tolerance(dtype))
    torch.testing.assert_close(normed.cpu(), ref_normed, **tolerance(dtype))


def test_rms_norm_of_strided_heads():
    """q and k norms see [tokens, heads, dim] views into the fused qkv output."""
    qkv = torch.randn(3, 6 * 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    norm = RMSNorm(16, 1e-6, torch.float32)
    torch.testing.assert_close(
        rms_norm(q.to(DEVICE), norm.weight.to(DEVICE), 1e-6).cpu(), norm(q), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 64)])
def test_rotary_in_place_matches_torch(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0), torch.device("cpu"))
    positions = torch.tensor([0, 7, 300, 511, 2])
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(5, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(5, kv_heads, head_dim)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    ref_q, ref_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    fused = qkv.to(DEVICE)
    fq = fused[:, : heads * head_dim].view(5, heads, head_dim)
    fk = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(5, kv_heads, head_dim)
    apply_rotary_inplace(positions.to(DEVICE), fq, fk, rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    torch.testing.assert_close(fq.cpu(), ref_q, **tolerance(dtype))
    torch.testing.assert_close(fk.cpu(), ref_k, **tolerance(dtype))
    v = fused[:, (heads + kv_heads) * head_dim :]
    assert torch.equal(v.cpu(), qkv[:, (heads + kv_heads) * head_dim :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(
        dtype
    )  # width across two blocks
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_and_mul(x.to(DEVICE)).cpu(), F.silu(gate) * up, **tolerance(dtype)
    )


def test_offsets_past_two_to_the_31_do_not_wrap():
    """Token index times row stride passes 2**31 for long prompts of wide models (a 70B MLP is
    57,344 wide): offsets are 64-bit. Only three rows of the large buffer are ever touched."""
    stride = 2**30 + 1024
    storage = torch.empty(2 * stride + 2 * 64, dtype=torch.float16, device=DEVICE)
    x = storage.as_strided((3, 128), (stride, 1))
    x.copy_(torch.randn(3, 128).to(torch.float16))
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_and_mul(x).float().cpu(),
        (F.silu(gate).half().float() * up).cpu(),
        atol=4e-2,
        rtol=2e-2,
    )
