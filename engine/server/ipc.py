"""ZMQ endpoints between the server's processes. Every link is PUSH -> PULL over an ipc://
socket, so messages are queued, never dropped, and arrive in order."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Endpoints:
    tokenizer_in: str  # API server -> tokenizer
    scheduler_in: str  # tokenizer (and bootstrap process) -> scheduler rank 0
    detokenizer_in: str  # scheduler rank 0 -> detokenizer
    api_in: str  # detokenizer -> API server
    bootstrap_in: str  # scheduler rank 0 -> bootstrap process (prefill and decode roles)

    @classmethod
    def create(cls) -> Endpoints:
        folder = tempfile.mkdtemp(prefix="kubesgl-ipc-")
        names = ("tokenizer", "scheduler", "detokenizer", "api", "bootstrap")
        return cls(*(f"ipc://{os.path.join(folder, name)}" for name in names))


def pull(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    return socket


def push(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 2000)  # deliver what was sent (Shutdown, say), but never hang on exit
    socket.connect(address)
    return socket
