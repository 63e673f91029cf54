"""Starts real `kubesgl serve` and `kubesgl router` processes on loopback ports and looks at
them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    log_path: str

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metric(self, selector: str) -> float:
        """The first sample that `selector` (`name` or `name{label="value",...}`) picks: named so,
        with those labels among its own (model_name and role are on every one)."""
        name, _, matchers = selector.partition("{")
        wanted = dict(m.split("=", 1) for m in matchers.rstrip("}").split(",") if m)
        wanted = {label: value.strip('"') for label, value in wanted.items()}
        for family in text_string_to_metric_families(httpx.get(self.base_url + "/metrics").text):
            for sample in family.samples:
                if sample.name == name and wanted.items() <= sample.labels.items():
                    return sample.value
        raise KeyError(selector)

    def wait_healthy(self, timeout: float = 60) -> None:
        """Until /health answers 200 (an engine or a router). An AssertionError with the
        process's log when it exits first, or when `timeout` passes (it is killed then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.base_url} exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.process.kill()
        raise AssertionError(f"{self.base_url} not healthy after {timeout} s:\n{self.log()}")

    def wait_idle(self, timeout: float = 20) -> None:
        """Until the engine reports no running request and no KV held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("kubesgl_num_running_requests") == 0
                and self.metric("kubesgl_kv_cache_usage_ratio") == 0
            ):
                return
            time.sleep(0.05)
        raise AssertionError("engine did not become idle")

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


def start_process(command: str, *args: str, tmp_path, env: dict | None = None) -> RunningServer:
    """`kubesgl COMMAND ARGS` (serve or router) on a free loopback port, its output in
    tmp_path/COMMAND-PORT.log; not yet waited for (see RunningServer.wait_healthy)."""
    port = free_port()
    log_path = str(tmp_path / f"{command}-{port}.log")
    with open(log_path, "w") as log:  # the child writes through its own copy
        process = subprocess.Popen(
            [sys.executable, "-m", "kubesgl", command, "--port", str(port), "--host", "127.0.0.1"]
            + list(args),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return RunningServer(process, f"http://127.0.0.1:{port}", log_path)


def start_server(
    model: str, *args: str, tmp_path, env: dict | None = None, timeout: float = 120
) -> RunningServer:
    """A CPU float32 engine on `model`, once its /health passes."""
    server = start_process(
        "serve",
        "--model",
        model,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "32768",
        *args,
        tmp_path=tmp_path,
        env=env,
    )
    server.wait_healthy(timeout)
    return server


def start_router(
    *args: str, tmp_path, env: dict | None = None, timeout: float = 60
) -> RunningServer:
    """A router (its workers and options in `args`), once its /health passes."""
    router = start_process("router", *args, tmp_path=tmp_path, env=env)
    router.wait_healthy(timeout)
    return router


def process_tree_alive(pid: int) -> list[int]:
    """Pids of processes whose parent chain includes `pid` (the server's children)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if ppid == pid:
                alive.append(int(entry))
    return alive


def wait_until_gone(pids: list[int], timeout: float = 15) -> list[int]:
    """Pids still running (not zombies) once `timeout` has passed; children such as
    multiprocessing's resource tracker leave a moment after their parent."""

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
