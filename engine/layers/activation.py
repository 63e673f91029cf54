from collections.abc import Callable

import torch
import torch.nn.functional as F

from kubesgl.engine.layers.kernels import LayerKernels

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_activation(
    name: str, kernels: LayerKernels = "torch"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) * up over a tensor whose last dimension is [gate | up]; silu in one Triton
    kernel with `kernels="triton"`."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(_ACTIVATIONS)})")
    act = _ACTIVATIONS[name]
    if kernels == "triton" and name == "silu":
        from kubesgl.engine.layers.triton_kernels.activation import silu_and_mul

        return silu_and_mul

    def apply(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return apply
