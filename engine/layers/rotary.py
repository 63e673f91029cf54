"""Rotary position embedding with the scaling types transformers implements.

The inverse frequencies follow transformers' formulas for `default`, `linear`, `llama3`
and `yarn` (yarn also scales cos and sin by its attention factor). cos and sin are
cached in float32 for every position up to the context length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kubesgl.engine.layers.kernels import LayerKernels
from kubesgl.engine.model_config import RopeConfig, RopeType


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    original = rope.original_max_position_embeddings
    assert original is not None  # the config parser sets it for llama3 and yarn
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta
    original = rope.original_max_position_embeddings
    assert original is not None  # the config parser sets it for llama3 and yarn
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolated = 1 - ramp
    return interpolation * (
        1 - keep_extrapolated
    ) + extrapolation * keep_extrapolated, attention_factor


def _default_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    return 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )


def _default(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(head_dim, rope), 1.0


def _linear(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(head_dim, rope) / rope.factor, 1.0


def _llama3(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    return _llama3_inv_freq(_default_inv_freq(head_dim, rope), rope), 1.0


# Each rope type's (inverse frequencies, factor applied to cos and sin) for a head size.
ROPE_SCALINGS: dict[RopeType, Callable[[int, RopeConfig], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn_inv_freq,
}


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor applied to cos and sin)."""
    return ROPE_SCALINGS[rope.rope_type](head_dim, rope)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place of their halves (the "rotate_half" layout of Llama)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        device: torch.device,
        kernels: LayerKernels = "torch",
    ):
        super().__init__()
        self.kernels = kernels
        inv_freq, scale = rope_inv_freq(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (freqs.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. With
        `kernels="triton"`, q and k are rotated in place, in one kernel."""
        if self.kernels == "triton":
            from kubesgl.engine.layers.triton_kernels.rotary import apply_rotary_inplace

            apply_rotary_inplace(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
