"""kubesgl.contract, the vocabulary the engine, the router and the operator share: its typing
aliases agree with its constants, and it, the router and the operator import without torch
(their pods carry no GPU stack, and `kubesgl render` runs where torch is not installed), as does
`kubesgl up` (which loads torch only to count GPUs, for a spec that asks for them)."""

from __future__ import annotations

import subprocess
import sys
import typing

from kubesgl import contract
from kubesgl.engine.messages import BootstrapTarget

# Every module of the two packages, imported in a fresh interpreter (this one may hold torch).
IMPORT_ALL = """
import importlib, pkgutil, sys
import kubesgl.contract, kubesgl.operator, kubesgl.router, kubesgl.up
for package in (kubesgl.router, kubesgl.operator, kubesgl.up):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
        assert "torch" not in sys.modules, f"importing {module.name} imported torch"
"""


def test_contract_router_and_operator_import_without_torch():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_role_types_name_the_role_constants():
    assert typing.get_args(contract.EngineRole) == contract.ENGINE_ROLES
    assert typing.get_args(contract.PodRole) == (*contract.ENGINE_ROLES, contract.ROUTER)


def test_every_component_uses_the_contract_roles():
    from kubesgl.engine.config import ENGINE_OPTIONS
    from kubesgl.router.workers import Role

    assert ENGINE_OPTIONS["role"].choices == contract.ENGINE_ROLES
    assert tuple(Role) == contract.ENGINE_ROLES


def test_a_bootstrap_address_of_an_ipv6_host_is_a_url():
    # an IPv6 pod's prefill engine: http://fd00::5:8998 is no URL (a decode engine's posts and
    # the router's room cancels went nowhere)
    assert contract.http_url("fd00::5", 8998) == "http://[fd00::5]:8998"
    assert contract.http_url("10.0.0.5", 8998) == "http://10.0.0.5:8998"
    assert BootstrapTarget(1, "fd00::5", 8998).address == "http://[fd00::5]:8998"
