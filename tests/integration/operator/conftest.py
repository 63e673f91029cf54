"""Fixtures: a fresh API emulator per test and the operator running against it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_api_server import running_api_server
from operator_harness import Cluster, OperatorProcess


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_api_server() as server:
        yield Cluster(server)


@pytest.fixture
def operator(cluster: Cluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    kubeconfig = cluster.server.write_kubeconfig(tmp_path / "kubeconfig")
    process = OperatorProcess(kubeconfig, tmp_path / "operator.log")
    process.start()
    yield process
    process.stop()
    assert "Traceback" not in process.log(), process.log()
