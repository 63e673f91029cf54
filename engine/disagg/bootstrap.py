"""The bootstrap handshake over HTTP (docs/disaggregation.md, the bootstrap server), in a process
of its own beside the engine's schedulers (`run_bootstrap`), so that no network I/O waits on
a scheduler busy with steps (it holds the GIL for most of every step).

A prefill engine serves `BootstrapServer` (bootstrap_server.py) on
`--disaggregation-bootstrap-port`; a decode engine's `BootstrapClient` (bootstrap_client.py)
registers there, posts its rooms and watches the prefill engines it has rooms at. The
scheduler's first request makes this process one or the other (`BootstrapService`); what
either side learns goes to the scheduler as a `BootstrapFact`.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading

import zmq

from kubesgl.engine.child_process import exit_with_parent
from kubesgl.engine.disagg.bootstrap_client import BootstrapClient
from kubesgl.engine.disagg.bootstrap_server import BootstrapServer
from kubesgl.engine.disagg.protocol import (
    BootstrapFact,
    BootstrapRequest,
    ConnectBootstrap,
    Emit,
    ServeBootstrap,
)
from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import Shutdown

logger = logging.getLogger(__name__)


class BootstrapService:
    """The bootstrap process's work: its first request makes it a prefill engine's server
    (ServeBootstrap) or a decode engine's client (ConnectBootstrap), which takes the
    scheduler's requests from then on."""

    def __init__(self, emit: Emit):
        self.emit = emit
        self.side: BootstrapServer | BootstrapClient | None = None

    def handle(self, request: BootstrapRequest) -> None:
        if self.side is None:
            self.side = self._start(request)
        else:
            self.side.handle(request)

    def _start(self, request: BootstrapRequest) -> BootstrapServer | BootstrapClient:
        if isinstance(request, ServeBootstrap):
            server = BootstrapServer(self.emit, request)
            logger.info("bootstrap server listening on %s:%d", request.host, server.port)
            return server
        if isinstance(request, ConnectBootstrap):
            return BootstrapClient(self.emit, request)
        raise TypeError(f"ServeBootstrap or ConnectBootstrap comes first, not {request!r}")

    @property
    def server(self) -> BootstrapServer | None:
        """The prefill engine's server, once ServeBootstrap came."""
        return self.side if isinstance(self.side, BootstrapServer) else None

    def close(self) -> None:
        if self.side is not None:
            self.side.close()


def quiet_request_logs() -> None:
    """httpx logs every request at INFO: a decode engine's heartbeat, every 2 s, would fill
    its log at rest. Failures that matter are logged here; `--log-level debug` shows all."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run_bootstrap(endpoints: Endpoints, log_level: str) -> None:
    """The bootstrap process: requests from scheduler rank 0 in, facts out to its inbox."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s bootstrap %(levelname)s %(message)s"
    )
    quiet_request_logs()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    context = zmq.Context()
    requests = pull(context, endpoints.bootstrap_in)
    facts: queue.Queue[BootstrapFact | None] = queue.Queue()

    def forward() -> None:  # the one thread that owns the socket to the scheduler
        to_scheduler = push(context, endpoints.scheduler_in)
        while (fact := facts.get()) is not None:
            to_scheduler.send_pyobj(fact)

    forwarder = threading.Thread(target=forward, name="kubesgl-bootstrap-facts", daemon=True)
    forwarder.start()
    service = BootstrapService(facts.put)
    while not isinstance(request := requests.recv_pyobj(), Shutdown):
        service.handle(request)
    service.close()
    facts.put(None)
    forwarder.join(timeout=5)
