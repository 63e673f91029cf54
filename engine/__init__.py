"""kubesgl's serving engine: `from kubesgl.engine import LLM, SamplingParams`.

These names load on first use, not with the package: the operator reads the engine's options
(kubesgl.engine.config) and must not import torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubesgl.engine.llm import LLM, RequestOutput
    from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams

_MODULE_OF = {
    "LLM": "kubesgl.engine.llm",
    "RequestOutput": "kubesgl.engine.llm",
    "SamplingParams": "kubesgl.engine.sampling_params",
    "InvalidRequestError": "kubesgl.engine.sampling_params",
}

__all__ = ["LLM", "RequestOutput", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
