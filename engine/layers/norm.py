import torch
from torch import nn

from kubesgl.engine.layers.kernels import LayerKernels


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementations do.

    With `residual`, adds it first and returns (norm(x + residual), x + residual): the
    residual stream of a decoder layer in one kernel with `kernels="triton"`."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, kernels: LayerKernels = "torch"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernels == "triton":
            from kubesgl.engine.layers.triton_kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
