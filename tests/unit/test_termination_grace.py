"""A pod's terminationGracePeriodSeconds covers the worst-case exit of what runs in it: the
kubelet kills the pod at the end of the grace period, counted from the start of the preStop
hook, so the engine must have had its whole drain (--shutdown-timeout) and the time it takes
to exit after it. The engine's part is measured here on the launcher's own drain and stop code,
with requests that never finish and child processes that never stop, on a simulated clock;
raise ENGINE_EXIT_AFTER_DRAIN_SECONDS (operator/render/engine.py) when this test fails."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubesgl.operator.render import render
from kubesgl.operator.render.engine import (
    ENGINE_EXIT_AFTER_DRAIN_SECONDS,
    EXIT_SLACK_SECONDS,
    PRESTOP_SLEEP_SECONDS,
)
from kubesgl.operator.validation import parse_inference_service
from kubesgl.up.plan import LocalSettings, plan

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def pods(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        obj["metadata"]["labels"]["kubesgl.io/role"]: obj["spec"]["template"]["spec"]
        for obj in render(parse_inference_service(document))
        if obj["kind"] == "Deployment"
    }


@pytest.mark.parametrize("shutdown_timeout", [1, 60, 600])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_engine_grace_period_is_pause_plus_drain_plus_exit(path, shutdown_timeout):
    document = yaml.safe_load(path.read_text())
    document["spec"].setdefault("engine", {})["shutdownTimeoutSeconds"] = shutdown_timeout
    for role, pod in pods(document).items():
        container = pod["containers"][0]
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pause == PRESTOP_SLEEP_SECONDS
        if role == "router":
            # the pause, uvicorn's graceful shutdown (the router's --shutdown-timeout, the
            # engines' drain) and slack
            args = container["args"]
            assert args[args.index("--shutdown-timeout") + 1] == str(shutdown_timeout)
            assert pod["terminationGracePeriodSeconds"] == (
                pause + shutdown_timeout + EXIT_SLACK_SECONDS
            )
            continue
        args = container["args"]
        drain = float(args[args.index("--shutdown-timeout") + 1])
        assert drain == shutdown_timeout
        assert pod["terminationGracePeriodSeconds"] == (
            pause + drain + ENGINE_EXIT_AFTER_DRAIN_SECONDS + EXIT_SLACK_SECONDS
        )


def test_kubesgl_up_stops_processes_within_the_same_budget():
    document = yaml.safe_load((EXAMPLES[0].parent / "quickstart.yaml").read_text())
    document["spec"]["engine"]["shutdownTimeoutSeconds"] = 42
    local = plan(
        parse_inference_service(document),
        LocalSettings(free_port=iter(range(41000, 41100)).__next__),
    )
    # no preStop pause here: the router is stopped before the engines
    assert {engine.stop_timeout_s for engine in local.engines} == {
        42 + ENGINE_EXIT_AFTER_DRAIN_SECONDS + EXIT_SLACK_SECONDS
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await _real_sleep(0)


_real_sleep = asyncio.sleep


class Overlay:
    """A module with some of its functions replaced."""

    def __init__(self, module: types.ModuleType, **replaced: Any):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


class StuckClient:
    """Requests that never end, aborted or not."""

    in_flight = 3

    async def abort_all(self, message: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass


class StuckChild:
    """A scheduler that ignores its Shutdown message until it is killed."""

    def __init__(self, clock: Clock):
        self.clock, self.killed = clock, False
        self.exitcode = None

    def is_alive(self) -> bool:
        return not self.killed

    def join(self, timeout: float | None = None) -> None:
        if not self.killed:
            assert timeout is not None, "waits forever for a child that does not stop"
            self.clock.now += timeout

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        self.killed = True


@contextlib.contextmanager
def server_of(launcher: types.ModuleType, options: Any) -> Iterator[Any]:
    """The engine's Server, its processes not started; its socket folder removed after."""
    from kubesgl.engine.config import EngineConfig

    config = EngineConfig(model="unused")
    server = launcher.Server(config, options)
    try:
        yield server
    finally:
        shutil.rmtree(
            Path(server.endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True
        )


def _uvicorn_graceful_shutdown_s(
    launcher: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> float:
    """How long the engine's uvicorn waits for open connections once it is told to exit."""
    captured: dict[str, Any] = {}

    class Captured(Exception):
        pass

    def config(*args: Any, **kwargs: Any) -> None:
        captured.update(kwargs)
        raise Captured

    monkeypatch.setattr(launcher.uvicorn, "Config", config)
    with server_of(launcher, launcher.ServerOptions()) as server, pytest.raises(Captured):
        asyncio.run(server._serve())
    # uvicorn's own default when the launcher sets none: wait for connections as long as they last
    timeout = captured.get("timeout_graceful_shutdown")
    assert timeout is not None, "the engine's uvicorn waits forever for open connections"
    return float(timeout)


def test_a_server_that_fails_to_start_serving_closes_its_engine_client(monkeypatch):
    # Its zmq context, left open, hung a later test's garbage collection (pyzmq's term()
    # waits for open sockets): the whole CI run stopped in an unrelated test.
    from kubesgl.engine.server import launcher

    class Refused(Exception):
        pass

    def config(*args: Any, **kwargs: Any) -> None:
        raise Refused

    monkeypatch.setattr(launcher.uvicorn, "Config", config)
    with server_of(launcher, launcher.ServerOptions()) as server, pytest.raises(Refused):
        asyncio.run(server._serve())
    assert server._client._context.closed


def test_the_engine_exits_within_its_budget_after_the_drain(monkeypatch):
    # imported here, not at the top: the other tests need no engine
    from kubesgl.engine.server import launcher

    clock = Clock()
    monkeypatch.setattr(launcher, "time", Overlay(launcher.time, monotonic=clock.monotonic))
    monkeypatch.setattr(launcher, "asyncio", Overlay(launcher.asyncio, sleep=clock.sleep))
    shutdown_timeout = 7.0
    with server_of(launcher, launcher.ServerOptions(shutdown_timeout=shutdown_timeout)) as server:
        # the most children a pod has: 8 tensor-parallel ranks, the tokenizer, the bootstrap server
        children = [*(f"scheduler rank {rank}" for rank in range(8)), "tokenizer", "bootstrap"]
        server.children = {name: StuckChild(clock) for name in children}
        uvicorn_server = types.SimpleNamespace(should_exit=False)
        state = types.SimpleNamespace(draining=False)

        _real_run(server._drain(uvicorn_server, StuckClient(), state))  # SIGTERM at clock 0
        assert (
            uvicorn_server.should_exit and clock.now >= shutdown_timeout
        )  # the whole drain was given
        drained = clock.now
        server._stop_children()
        assert all(child.killed for child in server.children.values())
        stopping_children = clock.now - drained
    monkeypatch.undo()

    after_drain = (
        (drained - shutdown_timeout)
        + _uvicorn_graceful_shutdown_s(launcher, monkeypatch)
        + stopping_children
    )
    assert after_drain <= ENGINE_EXIT_AFTER_DRAIN_SECONDS, (
        f"the engine may take {after_drain:g} s to exit after its drain: more than the "
        f"{ENGINE_EXIT_AFTER_DRAIN_SECONDS} s the pods' grace period allows"
    )


_real_run = asyncio.run
