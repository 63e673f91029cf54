"""What the engine needs to know of a Hugging Face checkpoint, read from its JSON files.

The raw `config.json` is parsed here rather than through transformers' config classes so
that old (`rope_scaling` + `rope_theta`) and new (`rope_parameters`) spellings both work
and every field the engine depends on is checked in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args


@dataclass(frozen=True)
class Architecture:
    """How a Llama-like architecture departs from Llama: the decoder reads these as data."""

    qkv_bias: bool = False  # bias on q, k and v (not o) whatever `attention_bias` says (Qwen2)
    qk_norm: bool = False  # RMS norms on q and k per head (Qwen3)
    window_on_every_layer: bool = (
        False  # `sliding_window` applies to all layers, unflagged (Mistral)
    )
    moe: bool = False  # sparse MoE blocks in place of the MLP (Qwen3-MoE)


# The architectures the engine serves, by the name of config.json's `architectures`: one entry
# adds a Llama-like one.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),
    "MistralForCausalLM": Architecture(window_on_every_layer=True),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(qk_norm=True),
    "Qwen3MoeForCausalLM": Architecture(qk_norm=True, moe=True),
}


# The RoPE scalings the engine implements (engine/layers/rotary.py), by config.json's rope_type.
RopeType = Literal["default", "linear", "llama3", "yarn"]


class ModelConfigError(ValueError):
    """The checkpoint cannot be served: unsupported architecture or an inconsistent config."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: RopeType = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    hidden_act: str
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    moe: MoeConfig | None
    eos_token_ids: frozenset[int]
    torch_dtype: str | None

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings


def _rope_type(params: dict[str, Any]) -> RopeType:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in get_args(RopeType):
        raise ModelConfigError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(get_args(RopeType))})"
        )
    return cast(RopeType, rope_type)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = _rope_type(params)
    original = params.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn"):
        original = raw.get("original_max_position_embeddings", raw["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _sliding_windows(
    raw: dict[str, Any], arch: Architecture, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch.window_on_every_layer:
        return (window,) * num_layers
    layer_types = raw.get("layer_types")
    if not raw.get("use_sliding_window") or not window:
        return (None,) * num_layers
    if layer_types is None:  # Qwen2-style: layers from max_window_layers on use the window
        first = raw.get("max_window_layers", num_layers)
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _eos_ids(*values: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    architectures = raw.get("architectures") or []
    supported = [a for a in architectures if a in ARCHITECTURES]
    if not supported:
        raise ModelConfigError(
            f"unsupported architecture {architectures or '(none given)'}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    name = supported[0]
    arch = ARCHITECTURES[name]
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // num_heads
    num_layers = raw["num_hidden_layers"]
    moe = None
    if arch.moe:
        step = raw.get("decoder_sparse_step", 1)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        num_experts: int = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["moe_intermediate_size"],
            normalize_top_k=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=frozenset(
                i
                for i in range(num_layers)
                if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
            ),
        )
    generation = generation or {}
    return ModelConfig(
        architecture=name,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        qkv_bias=arch.qkv_bias or bool(raw.get("attention_bias")),
        o_proj_bias=not arch.qkv_bias and bool(raw.get("attention_bias")),
        mlp_bias=bool(raw.get("mlp_bias")),
        qk_norm=arch.qk_norm,
        sliding_windows=_sliding_windows(raw, arch, num_layers),
        moe=moe,
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def load_model_config(model_path: str | Path) -> ModelConfig:
    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelConfigError(
            f"{path} has no config.json (expected a Hugging Face checkpoint directory)"
        )
    raw = json.loads(config_file.read_text())
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return parse_model_config(raw, generation)
