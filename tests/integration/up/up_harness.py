"""Runs `kubesgl up` as a user would, in a process of its own, and looks at what it prints, at
its process tree and at the sockets it listens on (Linux's /proc)."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# What the tests ask, of `kubesgl up` and of a plain engine (conftest.py)
PROMPTS = ["The capital of France is", "Count from one to ten:", "Kubernetes schedules pods"]
CHAT = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, by parent links in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def listening_addresses(pids: list[int]) -> set[str]:
    """The addresses on which these processes' TCP sockets listen, from Linux's /proc."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or a descriptor closed meanwhile
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                packed = bytes.fromhex(fields[1].split(":")[0])
                # each 32-bit word in the host's (little-endian) order
                words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
                addresses.add(str(ipaddress.ip_address(words)))
    return addresses


def running(pid: int) -> bool:
    """Alive and not a zombie (zombies are dead; their parent reaps them)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class RunningUp:
    def __init__(self, spec: Path, tmp_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.out_path = tmp_path / "up.out"
        self.log_dir = tmp_path / "logs"
        self.started = time.monotonic()
        with self.out_path.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kubesgl",
                    "up",
                    "-f",
                    str(spec),
                    "--port",
                    str(self.port),
                    "--logs",
                    str(self.log_dir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out_path.read_text()

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 300) -> re.Match[str]:
        """The first line matching `pattern` in the output past character `after`."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.output()[after:], re.M)
            if found:
                return found
            assert self.process.poll() is None, (
                f"kubesgl up exited with {self.process.returncode}:\n{self.output()}"
            )
            assert time.monotonic() < deadline, (
                f"no {pattern!r} after {timeout} s:\n{self.output()}"
            )
            time.sleep(0.2)

    def engine_pid(self, name: str) -> int:
        """The pid of a replica as the last event about it names it."""
        return int(re.findall(rf"^\S+ {name}: started, pid (\d+)$", self.output(), re.M)[-1])

    def completion(self, prompt: str, max_tokens: int = 16) -> httpx.Response:
        return httpx.post(
            self.base_url + "/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )

    def interrupt(self, signum: int = signal.SIGINT, timeout: float = 120) -> tuple[int, list[int]]:
        """Ctrl-C (or `signum`): (the exit status, the processes of the tree still running afterwards)."""
        tree = descendants(self.process.pid)
        self.process.send_signal(signum)
        status = self.process.wait(timeout=timeout)
        return status, [pid for pid in tree if running(pid)]

    def kill(self) -> None:
        """After a failed test: nothing may outlive it."""
        tree = descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in tree:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
