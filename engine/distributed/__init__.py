"""Tensor-parallel process group: which rank this process is and the collectives it needs."""

from kubesgl.engine.distributed.parallel_state import (
    TensorParallelGroup,
    get_tp_group,
    init_tensor_parallel,
)

__all__ = ["TensorParallelGroup", "get_tp_group", "init_tensor_parallel"]
