"""The tensor-parallel group of this process.

With one rank every collective is the identity and torch.distributed is never touched, so
the single-process engine has no distributed dependency. With more ranks the same calls go
through torch.distributed (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    # gloo group for host-side agreement between the ranks' schedulers (what to run, which
    # KV transfers ended), apart from the model's collectives, which may run on NCCL
    control: dist.ProcessGroup | None = None

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` items."""
        if total % self.size:
            raise ValueError(
                f"{total} does not divide evenly over {self.size} tensor-parallel ranks"
            )
        part = total // self.size
        return self.rank * part, part


_group = TensorParallelGroup()


def init_tensor_parallel(
    rank: int, size: int, init_method: str | None = None, backend: str | None = None
) -> None:
    """Join the group. `init_method` is a torch.distributed URL such as tcp://127.0.0.1:PORT."""
    global _group
    control = None
    if size > 1:
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        control = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
    _group = TensorParallelGroup(rank=rank, size=size, control=control)


def get_tp_group() -> TensorParallelGroup:
    return _group
