"""The batch-1 GEMV kernel against torch's linear. On a machine without a GPU it runs in
Triton's interpreter (TRITON_INTERPRET=1), which executes the same kernel code."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from kubesgl.engine.layers.triton_kernels.gemv import gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "block_n"),
    [(96, 64, None), (40, 48, 16), (7, 200, 4), (130, 512, 8)],  # ragged rows, K not a power of 2
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype, n, k, block_n, bias):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = gemv(x, w, b, block_n=block_n)
    assert out.shape == (1, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_gemv_refuses_more_than_one_row_and_a_wrong_width():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.zeros(1, 8, device=DEVICE), w)


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_layers_and_the_lm_head_run_one_row_through_the_gemv(monkeypatch, rows):
    from kubesgl.engine.layers import linear as linear_module
    from kubesgl.engine.layers.embedding import VocabParallelEmbedding
    from kubesgl.engine.layers.triton_kernels import gemv as gemv_module

    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda *args: calls.append(args) or F.linear(*args))
    column = linear_module.ColumnParallelLinear(16, [8, 4], True, torch.float32, "triton")
    row = linear_module.RowParallelLinear(12, 16, True, torch.float32, kernels="triton")
    gen = torch.Generator().manual_seed(0)
    for param in (*column.parameters(), *row.parameters()):
        param.data.copy_(torch.randn(param.shape, generator=gen))
    lm_head = VocabParallelEmbedding(10, 16, torch.float32, "triton")
    lm_head.weight.data.copy_(torch.randn(lm_head.weight.shape, generator=gen))
    x = torch.randn(rows, 16, generator=gen)
    out = row(column(x))
    expected = F.linear(F.linear(x, column.weight, column.bias), row.weight, row.bias)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lm_head.logits(out), F.linear(out, lm_head.weight))
    assert len(calls) == (3 if rows == 1 else 0)


def test_one_row_the_gemv_cannot_take_goes_to_torch(monkeypatch):
    """A 3-D input, a transposed weight, or mixed dtypes: F.linear's answer (or its error)."""
    from kubesgl.engine.layers.linear import linear
    from kubesgl.engine.layers.triton_kernels import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "gemv", lambda *args: pytest.fail("took the GEMV"))
    w = torch.randn(8, 16)
    assert linear(torch.randn(1, 3, 16), w, None, "triton").shape == (1, 3, 8)
    assert linear(torch.randn(1, 16), torch.randn(16, 8).t(), None, "triton").shape == (1, 8)
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 16), w.bfloat16(), None, "triton")
