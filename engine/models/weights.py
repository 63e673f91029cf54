"""Checkpoint tensors: read from safetensors files, or made up from the config.

`synthetic_checkpoint` produces the tensors a Hugging Face checkpoint of this config would
hold, seeded per tensor name, so that `--load-format dummy` gives the same weights at any
tensor-parallel size and `make-tiny-model` can write a real checkpoint from it.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kubesgl.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in a Hugging Face checkpoint of `config`."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        attn = {
            "q_proj": config.num_heads * d,
            "k_proj": config.num_kv_heads * d,
            "v_proj": config.num_kv_heads * d,
        }
        for name, out in attn.items():
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        moe = config.moe
        if moe is not None and i in moe.sparse_layers:
            shapes[p + "mlp.gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                q = p + f"mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (moe.intermediate_size, h)
                shapes[q + "up_proj.weight"] = (moe.intermediate_size, h)
                shapes[q + "down_proj.weight"] = (h, moe.intermediate_size)
        else:
            for name, shape in (
                ("gate_proj", (config.intermediate_size, h)),
                ("up_proj", (config.intermediate_size, h)),
                ("down_proj", (h, config.intermediate_size)),
            ):
                shapes[p + f"mlp.{name}.weight"] = shape
                if config.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def synthetic_checkpoint(
    config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights with healthy activations: matrices ~ N(0, 1/fan_in), norms near 1."""
    for name, shape in checkpoint_shapes(config).items():
        generator = torch.Generator(device=device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif "embed_tokens" in name:
            tensor = noise
        else:
            tensor = noise / shape[-1] ** 0.5
        yield name, tensor.to(dtype)


def safetensors_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_path} has no *.safetensors files (use --load-format dummy for random weights)"
        )
    return files


PROGRESS_EVERY_S = (
    5.0  # a log line this often while weights load (a 1B model took 15 s without one)
)


def read_safetensors(
    model_path: Path, dtype: torch.dtype, log: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in `dtype`. `log`: say how much there is, how far the reading
    is every PROGRESS_EVERY_S seconds, and how long it took."""
    files = safetensors_files(model_path)
    total = sum(file.stat().st_size for file in files)
    say = logger.info if log else logger.debug
    say("loading weights: %d file(s), %.2f GiB from %s", len(files), total / 2**30, model_path)
    start = last = time.monotonic()
    done = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                done += tensor.nbytes
                yield name, tensor.to(dtype)
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(
                        "loading weights: %.2f of %.2f GiB (%.0f%%), %.0f s",
                        done / 2**30,
                        total / 2**30,
                        100 * done / max(total, 1),
                        last - start,
                    )
    say("weights loaded: %.2f GiB in %.1f s", done / 2**30, time.monotonic() - start)
