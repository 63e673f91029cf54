"""Fixtures that start real `kubesgl serve` processes (see serve_harness.py)."""

from __future__ import annotations

import pytest
from serve_harness import RunningServer, start_server


@pytest.fixture
def server_factory(tmp_path):
    started: list[RunningServer] = []

    def make(model: str, *args: str, **kwargs) -> RunningServer:
        server = start_server(model, *args, tmp_path=tmp_path, **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="module")
def llama_server(tiny_model, tmp_path_factory):
    server = start_server(
        tiny_model("llama"),
        "--api-key",
        "sk-test",
        "--served-model-name",
        "tiny",
        tmp_path=tmp_path_factory.mktemp("serve"),
    )
    yield server
    assert server.stop() == 0
