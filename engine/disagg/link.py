"""The scheduler's end of the bootstrap process (rank 0 only): bootstrap requests go out,
facts come back to be applied in the scheduler's next turn.

`ProcessLink` talks to the engine's bootstrap process over ZMQ (what `kubesgl serve` runs);
its facts arrive in the scheduler's inbox and the scheduler loop hands them over with
`deliver`. `LocalLink` runs the same bootstrap service on threads of this process, for an
engine driven in process (tests)."""

from __future__ import annotations

import queue

import zmq

from kubesgl.engine.disagg.bootstrap import BootstrapService
from kubesgl.engine.disagg.protocol import BootstrapFact, BootstrapRequest
from kubesgl.engine.messages import Shutdown


class BootstrapLink:
    def __init__(self) -> None:
        self._facts: queue.Queue[BootstrapFact] = queue.Queue()  # filled from other threads

    def send(self, request: BootstrapRequest) -> None:
        raise NotImplementedError

    def deliver(self, fact: BootstrapFact) -> None:
        self._facts.put(fact)

    def drain(self) -> list[BootstrapFact]:
        facts = []
        while not self._facts.empty():
            facts.append(self._facts.get())
        return facts

    def close(self) -> None:
        pass


class ProcessLink(BootstrapLink):
    def __init__(self, socket: zmq.Socket):
        super().__init__()
        self.socket = socket

    def send(self, request: BootstrapRequest) -> None:
        self.socket.send_pyobj(request)

    def close(self) -> None:
        self.socket.send_pyobj(Shutdown())


class LocalLink(BootstrapLink):
    def __init__(self) -> None:
        super().__init__()
        self.service = BootstrapService(self.deliver)

    def send(self, request: BootstrapRequest) -> None:
        self.service.handle(request)

    @property
    def port(self) -> int:
        """The bootstrap server's port (prefill role)."""
        assert self.service.server is not None, "ServeBootstrap comes first"
        return self.service.server.port

    def close(self) -> None:
        self.service.close()
