"""Each engine role is built by its own factory (roles.ROLE_FACTORIES), with its KV transfers
wired to this rank's pool; a mixed engine builds no NIXL agent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kubesgl import contract
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.link import LocalLink
from kubesgl.engine.scheduler import roles


class Recorded:
    """Stands in for a class of the KV transfer: keeps the arguments it was built with."""

    made: list[Recorded] = []

    def __init__(self, *args: object) -> None:
        self.args = args
        self.metadata, self.layout = b"agent", "layout"
        Recorded.made.append(self)


@pytest.fixture
def built(monkeypatch):
    Recorded.made = []
    for name in ("KVTransferAgent", "PrefillTransfers", "DecodeTransfers"):
        monkeypatch.setattr(roles, name, type(name, (Recorded,), {}))
    tp = SimpleNamespace(rank=0, size=1, control=None)

    def build(role: contract.EngineRole) -> roles.Role:
        config = EngineConfig(model="m", role=role)
        return roles.create_role(config, "kv", "pool", tp, "10.0.0.1", None)  # type: ignore[arg-type]

    return build


def test_a_mixed_engine_builds_no_kv_transfer(built):
    role = built(contract.MIXED)
    assert isinstance(role, roles.MixedRole) and role.kv == "kv"
    assert Recorded.made == []


@pytest.mark.parametrize(
    ("role_name", "role_class", "transfers_class"),
    [
        (contract.PREFILL, roles.PrefillRole, "PrefillTransfers"),
        (contract.DECODE, roles.DecodeRole, "DecodeTransfers"),
    ],
)
def test_a_disaggregated_role_gets_transfers_over_this_ranks_agent(
    built, role_name, role_class, transfers_class
):
    role = built(role_name)
    assert isinstance(role, role_class) and role.name == role_name
    agent, transfers = Recorded.made
    assert type(agent).__name__ == "KVTransferAgent" and agent.args == ("pool",)
    assert type(transfers).__name__ == transfers_class and role.transfers is transfers
    assert transfers.args[0] is agent
    assert isinstance(transfers.args[2], LocalLink)  # rank 0 without a bootstrap process
