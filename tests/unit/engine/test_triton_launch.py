"""Programmatic dependent launch: chosen only where it exists, and every kernel launched with
it waits for its predecessor before touching memory (engine/triton_launch.py)."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

from kubesgl.engine import triton_launch  # noqa: E402
from kubesgl.engine.triton_launch import pdl_enabled  # noqa: E402

ENGINE = pathlib.Path(triton_launch.__file__).parent


@pytest.mark.parametrize(
    ("device", "capability", "interpreted", "expected"),
    [
        ("cpu", None, False, False),
        ("cuda", (9, 0), False, True),
        ("cuda:1", (10, 0), False, True),
        ("cuda", (8, 0), False, False),
        ("cuda", (9, 0), True, False),
    ],
)
def test_pdl_only_on_hopper_and_later_and_never_interpreted(
    monkeypatch, device, capability, interpreted, expected
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl_enabled(torch.device(device)) is expected


def test_cpu_launch_options_turn_pdl_off():
    assert triton_launch.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}


def _pdl_kernels() -> list[tuple[pathlib.Path, ast.FunctionDef]]:
    found = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "USE_PDL" in {a.arg for a in node.args.args}:
                found.append((path, node))
    return found


def test_every_pdl_kernel_waits_for_its_predecessor_first():
    kernels = _pdl_kernels()
    names = {node.name for _, node in kernels}
    # the layers' short kernels (the helper itself takes USE_PDL too)
    assert {"_rms_norm", "_rotary", "_silu_and_mul", "_store_kv", "wait_for_predecessor"} <= names
    for path, node in kernels:
        if node.name == "wait_for_predecessor":
            continue
        first = node.body[0]
        assert (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Call)
            and ast.unparse(first.value) == "wait_for_predecessor(USE_PDL)"
        ), f"{path.name}:{node.name} must call wait_for_predecessor(USE_PDL) before anything else"
