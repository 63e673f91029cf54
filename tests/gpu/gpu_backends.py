"""The attention backends the GPU tests run: Triton always, FlashInfer where it is installed."""

from __future__ import annotations

import importlib.util

import pytest

FLASHINFER = pytest.param(
    "flashinfer",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None,
        reason="FlashInfer is not installed here: pip install 'kubesgl[flashinfer]'",
    ),
)
BACKENDS = ["triton", FLASHINFER]
