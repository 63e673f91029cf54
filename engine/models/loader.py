"""Build a model from a checkpoint directory: config, dtype, weights."""

from __future__ import annotations

from pathlib import Path

import torch

from kubesgl.engine.config import LoadFormat
from kubesgl.engine.distributed import get_tp_group
from kubesgl.engine.layers.kernels import layer_kernels
from kubesgl.engine.model_config import ModelConfig
from kubesgl.engine.models.decoder import CausalLM
from kubesgl.engine.models.weights import read_safetensors, synthetic_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` keeps a half-precision checkpoint's dtype; a float32 checkpoint runs in
    float32 on the CPU and in bfloat16 on an accelerator."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {name!r} (supported: auto, {', '.join(_DTYPES)})")
        return _DTYPES[name]
    stored = _DTYPES.get(config.torch_dtype or "float32", torch.float32)
    if stored == torch.float32 and device.type != "cpu":
        return torch.bfloat16
    return stored


def load_model(
    model_path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat = "auto",  # checked by EngineConfig.validate, which Engine calls first
    seed: int = 0,
) -> CausalLM:
    with torch.device(device):
        model = CausalLM(config, dtype, device, layer_kernels(device))
    if load_format == "dummy":
        model.load_weights(synthetic_checkpoint(config, seed, dtype, device))
    else:
        model.load_weights(read_safetensors(Path(model_path), dtype, log=get_tp_group().rank == 0))
    return model.eval()
