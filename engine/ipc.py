"""ZMQ endpoints between the server's processes. Every link is PUSH -> PULL over an ipc://
socket, so messages are queued, never dropped, and arrive in order."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

# The socket class of the context: zmq.Socket, or zmq.asyncio.Socket whose sends are awaited.
SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")


@dataclass(frozen=True)
class Endpoints:
    tokenizer_in: str  # API server -> tokenizer
    scheduler_in: str  # tokenizer (and bootstrap process) -> scheduler rank 0
    detokenizer_in: str  # scheduler rank 0 -> detokenizer
    api_in: str  # detokenizer -> API server
    bootstrap_in: str  # scheduler rank 0 -> bootstrap process (prefill and decode roles)

    @classmethod
    def create(cls) -> Endpoints:
        """Sockets in a new folder named after this process; folders of servers that died
        without cleaning up (kill -9) are removed first."""
        remove_stale_folders()
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        names = ("tokenizer", "scheduler", "detokenizer", "api", "bootstrap")
        return cls(*(f"ipc://{os.path.join(folder, name)}" for name in names))


FOLDER_PREFIX = "kubesgl-ipc-"


def remove_stale_folders(root: str | None = None) -> None:
    """Remove socket folders whose server process is gone."""
    root = root or tempfile.gettempdir()
    for entry in os.scandir(root):
        owner = entry.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        if entry.name.startswith(FOLDER_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's, and alive
        return True
    return True


def pull(context: zmq.Context[SocketT], address: str) -> SocketT:
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    return socket


def push(context: zmq.Context[SocketT], address: str) -> SocketT:
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(
        zmq.LINGER, 2000
    )  # deliver what was sent (Shutdown, say), but never hang on exit
    socket.connect(address)
    return socket
