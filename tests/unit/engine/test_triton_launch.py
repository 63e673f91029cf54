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


def _functions_taking_use_pdl() -> dict[str, tuple[pathlib.Path, ast.FunctionDef]]:
    found = {}
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "USE_PDL" in {a.arg for a in node.args.args}:
                found[node.name] = (path, node)
    return found


def _statements(node: ast.FunctionDef) -> list[ast.stmt]:
    """The body without its docstring."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def test_the_wait_comes_before_letting_the_next_kernel_start():
    _, helper = _functions_taking_use_pdl()["wait_for_predecessor"]
    (branch,) = _statements(helper)
    assert isinstance(branch, ast.If) and ast.unparse(branch.test) == "USE_PDL"
    assert [ast.unparse(s) for s in branch.body] == [
        "tl.extra.cuda.gdc_wait()",
        "tl.extra.cuda.gdc_launch_dependents()",
    ]


# Kernels that load, before waiting, memory no kernel of a step writes (the model's weights):
# the parameters their early loads' addresses may use.
READ_BEFORE_THE_WAIT = {"_gemv": {"W", "K"}}


def test_every_pdl_kernel_waits_for_its_predecessor_first():
    kernels = _functions_taking_use_pdl()
    kernels.pop("wait_for_predecessor")
    # the layers' short kernels and the batch-1 GEMV
    assert {"_rms_norm", "_rotary", "_silu_and_mul", "_store_kv", "_gemv"} <= kernels.keys()
    for name, (path, node) in kernels.items():
        body = [ast.unparse(s) for s in _statements(node)]
        assert "wait_for_predecessor(USE_PDL)" in body, f"{path.name}:{name} never waits"
        before = _statements(node)[: body.index("wait_for_predecessor(USE_PDL)")]
        params = {a.arg for a in node.args.args}
        allowed = READ_BEFORE_THE_WAIT.get(name, set())
        for statement in before:
            for call in ast.walk(statement):
                if not isinstance(call, ast.Call):
                    continue
                callee = ast.unparse(call.func)
                assert callee != "tl.store" and "atomic" not in callee, (
                    f"{path.name}:{name} writes memory before wait_for_predecessor(USE_PDL)"
                )
                if callee == "tl.load":
                    read = {n.id for n in ast.walk(call.args[0]) if isinstance(n, ast.Name)}
                    assert read & params <= allowed, (
                        f"{path.name}:{name} reads {sorted(read & params - allowed)} before "
                        "wait_for_predecessor(USE_PDL): only what no kernel writes may be read early"
                    )
        assert before == [] or allowed, (
            f"{path.name}:{name} must call wait_for_predecessor(USE_PDL) before anything else"
        )


def test_only_pdl_launch_turns_pdl_on():
    """A kernel launched with `launch_pdl` by hand could skip the wait the test above checks."""
    for path in ENGINE.rglob("*.py"):
        if path.name != "triton_launch.py":
            assert "launch_pdl" not in path.read_text(), path
