"""Requests without a seed: each engine start draws its own numbers for them, and every
tensor-parallel rank of one engine the same ones."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.server import launcher
from kubesgl.engine.server.options import ServerOptions


def _scheduler_seeds(monkeypatch, tp_size: int) -> list[int]:
    """The sampling seed each scheduler rank of one server is started with."""
    started: list[tuple] = []

    class Process:
        def __init__(self, target, name, args):
            if target is launcher.run_scheduler:
                started.append(args)

        def start(self) -> None:
            pass

    monkeypatch.setattr(
        launcher.mp, "get_context", lambda method: types.SimpleNamespace(Process=Process)
    )
    server = launcher.Server(EngineConfig(model="unused", tp_size=tp_size), ServerOptions())
    try:
        server._start_children()
    finally:
        shutil.rmtree(
            Path(server.endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True
        )
    return [args[-1] for args in started]


def test_replicas_do_not_sample_unseeded_requests_alike(monkeypatch):
    """Every scheduler seeded torch with the engine's fixed seed (0): two replicas behind the
    router, or an engine and its restart, answered the same unseeded request with the same
    "random" text, in the same order. Each start now draws its own seed, as SGLang's; the
    ranks of one engine share it, so that they sample the same tokens."""
    first = _scheduler_seeds(monkeypatch, tp_size=2)
    second = _scheduler_seeds(monkeypatch, tp_size=2)
    assert len(first) == 2 and first[0] == first[1]
    assert first[0] != second[0]
