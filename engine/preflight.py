"""What can be checked of an engine's options before anything starts: the model, tensor
parallelism against its heads, the device, the attention backend, and the ports.

`kubesgl serve` runs these checks in its own process before it starts a child (a scheduler
that finds a mistake would print a traceback after the HTTP server came up), the offline
`LLM` before it loads weights. Each mistake is a `StartupError` whose message is one line
naming it and what to do instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

from kubesgl.contract import PREFILL
from kubesgl.engine.config import CUDA_ONLY_BACKENDS, AttentionBackendName, EngineConfig
from kubesgl.engine.model_config import ModelConfig, ModelConfigError, load_model_config
from kubesgl.engine.models.hub import HubError, resolve_model
from kubesgl.listen import CannotListen, bound_socket


class StartupError(ValueError):
    """An option this model or machine cannot run; the message is one line."""


class ModelStartupError(StartupError, ModelConfigError):
    """The checkpoint cannot be served (still a ModelConfigError to the offline LLM's callers)."""


def check_engine(config: EngineConfig) -> EngineConfig:
    """Raise StartupError for the first option the engine could not start with; return the
    config with `model` a local folder (a Hugging Face id is resolved to its snapshot in the
    Hub's cache, downloaded where it is not there). Reads the model's JSON files, no weights."""
    try:
        config.validate()
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    config = resolve_model_folder(config)
    model_config = read_model_config(config)
    check_tensor_parallel(model_config, config.tp_size)
    check_context_length(model_config, config.context_length)
    device = _device(config)
    _check_attention_backend(config, model_config, device)
    return config


def resolve_model_folder(config: EngineConfig) -> EngineConfig:
    """`config` with `--model` a local folder: a Hugging Face id becomes its snapshot's folder."""
    try:
        folder = resolve_model(config.model, weights=config.load_format != "dummy")
    except HubError as exc:
        raise StartupError(str(exc)) from None
    return config if folder == config.model else dataclasses.replace(config, model=folder)


def read_model_config(config: EngineConfig) -> ModelConfig:
    path = Path(config.model)
    if not path.exists():
        raise StartupError(
            f"--model {config.model}: no such directory (give a checkpoint directory or a "
            "Hugging Face id such as Qwen/Qwen3-0.6B)"
        )
    if not path.is_dir():
        raise StartupError(
            f"--model {config.model}: not a directory (give a Hugging Face checkpoint directory)"
        )
    try:
        model_config = load_model_config(path)
    except ModelConfigError as exc:
        raise ModelStartupError(f"--model {config.model}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise StartupError(
            f"--model {config.model}: a JSON file of the checkpoint is not valid JSON ({exc})"
        ) from None
    except KeyError as exc:
        raise StartupError(f"--model {config.model}: config.json has no {exc.args[0]!r}") from None
    if config.load_format == "auto":
        from kubesgl.engine.models.weights import safetensors_files

        try:
            files = safetensors_files(path)
        except FileNotFoundError as exc:
            raise StartupError(f"--model {config.model}: {exc}") from None
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise StartupError(
                f"--model {config.model}: weight files listed in its index are missing: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )
    return model_config


def tensor_parallel_problem(model: ModelConfig, tp_size: int) -> str | None:
    """Why the model's layers cannot be split over `tp_size` ranks, or None: the attention
    heads split evenly, the KV heads split or are replicated, the MLP's intermediate size
    (an expert's too) splits evenly."""
    if model.num_heads % tp_size:
        return f"its {model.num_heads} attention heads do not divide over {tp_size} ranks"
    if model.num_kv_heads % tp_size and tp_size % model.num_kv_heads:
        return f"its {model.num_kv_heads} KV heads can be neither split nor replicated over {tp_size} ranks"
    if model.intermediate_size % tp_size:
        return f"its MLP's intermediate size {model.intermediate_size} does not divide over {tp_size} ranks"
    if model.moe is not None and model.moe.intermediate_size % tp_size:
        return f"its experts' intermediate size {model.moe.intermediate_size} does not divide over {tp_size} ranks"
    return None


def check_tensor_parallel(model: ModelConfig, tp_size: int) -> None:
    problem = tensor_parallel_problem(model, tp_size)
    if problem:
        fits = [
            n for n in range(1, model.num_heads + 1) if tensor_parallel_problem(model, n) is None
        ]
        raise StartupError(
            f"--tp-size {tp_size} does not fit this model: {problem} "
            f"(sizes that fit: {', '.join(map(str, fits))})"
        )


def check_context_length(model: ModelConfig, context_length: int | None) -> None:
    """Beyond the model's own length the engine would serve the model's (positions past it
    were never trained): refused, as SGLang and vLLM refuse it, rather than cut silently."""
    if context_length is not None and context_length > model.context_length:
        raise StartupError(
            f"--context-length {context_length} exceeds this model's context length, "
            f"{model.context_length} (max_position_embeddings in its config.json); give at "
            f"most {model.context_length}, or leave it unset"
        )


def _device(config: EngineConfig) -> str:
    """cpu or cuda, as the engine will resolve it; a CUDA engine needs a GPU per rank."""
    import torch

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise StartupError("--device cuda was given but no CUDA device is available")
    gpus = torch.cuda.device_count()
    if config.tp_size > gpus:
        raise StartupError(
            f"--tp-size {config.tp_size} needs a GPU per rank; this machine has {gpus} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    return "cuda"


def backend_device_problem(backend: str, device: str, environ: Mapping[str, str]) -> str | None:
    """Why the attention backend cannot run on the device (`cpu` or `cuda`), in a process with
    these environment variables; None when it can. Torch-free: the operator checks its engine
    pods' options with it."""
    interpreted = backend == "triton" and environ.get("TRITON_INTERPRET") == "1"
    if device == "cpu" and backend in CUDA_ONLY_BACKENDS and not interpreted:
        return f"--attention-backend {backend} runs on CUDA GPUs; on the CPU use torch (or auto)"
    return None


def _check_attention_backend(config: EngineConfig, model: ModelConfig, device: str) -> None:
    backend = config.attention_backend
    problem = backend_device_problem(backend, device, os.environ)
    if problem is None and backend != "auto":  # auto picks one that fits
        problem = _backend_model_problem(backend, config, model, device)
    if problem is not None:
        raise StartupError(problem)


def _backend_model_problem(
    backend: AttentionBackendName, config: EngineConfig, model: ModelConfig, device: str
) -> str | None:
    """Why the backend cannot run this model, in the dtype the engine will load it in."""
    import torch

    from kubesgl.engine.attention import ATTENTION_BACKENDS
    from kubesgl.engine.models.loader import resolve_dtype

    dtype = resolve_dtype(config.dtype, model, torch.device(device))
    return ATTENTION_BACKENDS[backend].problem(dtype, model.head_dim)


def check_bootstrap_port(config: EngineConfig, host: str) -> None:
    """A prefill engine's KV bootstrap port must be free too (its bootstrap server binds it
    once the model is loaded)."""
    port = config.disaggregation_bootstrap_port
    if config.role != PREFILL or port == 0:
        return
    try:
        bound_socket(host, port, "--disaggregation-bootstrap-port").close()
    except CannotListen as exc:
        raise StartupError(str(exc)) from None
