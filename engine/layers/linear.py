"""Linear layers split over the tensor-parallel group.

Column-parallel layers split the output features, row-parallel layers split the input
features and all-reduce their partial sums. Each parameter carries a `weight_loader` that
takes the full checkpoint tensor and copies this rank's slice, so the model loader never
needs to know how a layer is sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kubesgl.engine.distributed import get_tp_group
from kubesgl.engine.layers.kernels import LayerKernels


def _attach_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: LayerKernels
) -> torch.Tensor:
    """x W^T + b; one row (a batch-1 decode step) through the Triton GEMV on CUDA, which
    starts streaming its weights before the kernel ahead of it has finished."""
    one_row = x.dim() == 2 and x.shape[0] == 1
    if kernels == "triton" and one_row and weight.is_contiguous() and x.dtype == weight.dtype:
        from kubesgl.engine.layers.triton_kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split over ranks.

    `output_sizes` lists the logical outputs fused into this layer (for example gate and
    up); each is split separately so that rank r holds the r-th slice of every one.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        kernels: LayerKernels = "torch",
    ):
        super().__init__()
        tp = get_tp_group()
        self.kernels = kernels
        self.output_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(size)[1] for size in self.output_sizes]
        out_local = sum(self.local_sizes)
        self.weight = _attach_loader(
            nn.Parameter(torch.empty(out_local, input_size, dtype=dtype), requires_grad=False),
            self._load,
        )
        self.bias = (
            _attach_loader(
                nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False), self._load
            )
            if bias
            else None
        )

    def _shard_offsets(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's parameter, start in the checkpoint tensor, size)."""
        tp = get_tp_group()
        offset = sum(self.local_sizes[:shard_id])
        size = self.local_sizes[shard_id]
        return offset, tp.rank * size, size

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset, start, size = self._shard_offsets(shard_id)
        if loaded.shape[0] != self.output_sizes[shard_id] or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"checkpoint tensor {tuple(loaded.shape)} does not fit output {shard_id} "
                f"({self.output_sizes[shard_id]} x {tuple(param.shape[1:])})"
            )
        param.data[offset : offset + size].copy_(loaded[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections; heads split over ranks, KV heads replicated when the
    group is larger than their count."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        kernels: LayerKernels = "torch",
    ):
        tp = get_tp_group()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not divide over {tp.size} ranks")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be split or replicated over {tp.size} ranks"
            )
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.total_kv_heads = num_kv_heads
        self.head_dim = head_dim
        kv_total_local = self.num_kv_heads * head_dim * tp.size  # replicated heads counted per rank
        super().__init__(
            hidden_size,
            [num_heads * head_dim, kv_total_local, kv_total_local],
            bias,
            dtype,
            kernels,
        )

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
        shard = self.SHARDS[shard_id] if isinstance(shard_id, str) else shard_id
        if shard == 0:
            return super()._load(param, loaded, 0)
        tp = get_tp_group()
        offset = sum(self.local_sizes[:shard])
        size = self.local_sizes[shard]
        expected = self.total_kv_heads * self.head_dim
        if loaded.shape[0] != expected:
            raise ValueError(
                f"checkpoint {'kv'[shard - 1]}_proj has {loaded.shape[0]} rows, expected {expected}"
            )
        # Rank r serves KV head r * total // size (a run of heads when the group is smaller).
        head = (
            tp.rank * self.total_kv_heads // tp.size
            if tp.size > self.total_kv_heads
            else tp.rank * self.num_kv_heads
        )
        start = head * self.head_dim
        param.data[offset : offset + size].copy_(loaded[start : start + size])


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split over ranks; partial sums are
    all-reduced, and the bias added once after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        reduce_results: bool = True,
        kernels: LayerKernels = "torch",
    ):
        super().__init__()
        tp = get_tp_group()
        self.kernels = kernels
        self.input_size = input_size
        self.local_input = tp.shard(input_size)[1]
        self.reduce_results = reduce_results
        self.weight = _attach_loader(
            nn.Parameter(
                torch.empty(output_size, self.local_input, dtype=dtype), requires_grad=False
            ),
            self._load,
        )
        self.bias = (
            _attach_loader(
                nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False),
                default_weight_loader,
            )
            if bias
            else None
        )

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (param.shape[0], self.input_size):
            raise ValueError(
                f"checkpoint tensor {tuple(loaded.shape)} does not fit ({param.shape[0]}, {self.input_size})"
            )
        start = get_tp_group().rank * self.local_input
        param.data.copy_(loaded[:, start : start + self.local_input])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.kernels)
        if self.reduce_results:
            y = get_tp_group().all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
