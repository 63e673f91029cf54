"""Starts and stops the server's processes: one scheduler per tensor-parallel rank, the
tokenizer/detokenizer, and the API server (uvicorn) in this process.

A child that dies, or the API server's reader of its outputs failing, takes the whole server
down with a log line naming it; SIGTERM drains: /health and new requests answer 503, requests
in flight get until the shutdown timeout to finish (then they are aborted), and every child is
stopped before this process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import secrets
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn

import kubesgl
from kubesgl import contract
from kubesgl.contract import MIXED, SERVER_KEEP_ALIVE_S
from kubesgl.engine.child_process import start_failure
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.bootstrap import run_bootstrap
from kubesgl.engine.disagg.prefill import CLOSE_WAIT_S
from kubesgl.engine.ipc import Endpoints
from kubesgl.engine.metrics import EngineMetrics
from kubesgl.engine.scheduler.process import run_scheduler
from kubesgl.engine.server.api import build_app
from kubesgl.engine.server.context import ServerState
from kubesgl.engine.server.engine_client import EngineClient
from kubesgl.engine.server.options import ServerOptions, served_model_name
from kubesgl.engine.tokenizer.process import run_tokenizer
from kubesgl.gc_pacing import GcPacer

logger = logging.getLogger("kubesgl.serve")

# How long the child processes get to stop once told to: a scheduler finishes its step in
# flight and a prefill engine's KV writes in flight (at most CLOSE_WAIT_S) before it exits.
CHILD_STOP_S = CLOSE_WAIT_S + 5.0


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM must drain first (Server._drain)."""

    def capture_signals(self):
        return contextlib.nullcontext()

    def install_signal_handlers(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions,
        listen_socket: socket.socket | None = None,
    ):
        """`listen_socket`: the HTTP API's, bound already (kubesgl.listen.listen_socket); without
        one, uvicorn binds host:port itself."""
        self.config = config
        self.options = options
        self.listen_socket = listen_socket
        # why a child ended the server: its own line, where it left one
        self.failure: str | None = None
        self.endpoints = Endpoints.create()
        # Requests without a seed sample from the schedulers' generator, seeded afresh at each
        # start (as SGLang's), so that replicas and restarts do not draw the same numbers, as
        # one fixed seed makes them. The tensor-parallel ranks share it, so that they sample
        # the same tokens.
        self.sampling_seed = secrets.randbits(63)
        self.children: dict[str, mp.process.BaseProcess] = {}
        self._stopping = threading.Event()
        self.exit_code = 0
        self._client: EngineClient | None = None  # the API server's, once it runs

    def _start_children(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.config.tp_size):
            self.children[f"scheduler rank {rank}"] = ctx.Process(
                target=run_scheduler,
                name=f"kubesgl-scheduler-{rank}",
                args=(
                    self.config,
                    rank,
                    self.endpoints,
                    init_method,
                    self.options.log_level,
                    self.options.host,
                    self.sampling_seed,
                ),
            )
        self.children["tokenizer"] = ctx.Process(
            target=run_tokenizer,
            name="kubesgl-tokenizer",
            args=(self.config.model, self.endpoints, self.options.log_level),
        )
        if self.config.role != MIXED:  # the HTTP side of the KV handshake, off the schedulers' GIL
            self.children["bootstrap"] = ctx.Process(
                target=run_bootstrap,
                name="kubesgl-bootstrap",
                args=(self.endpoints, self.options.log_level),
            )
        for child in self.children.values():
            child.start()

    def _watch_children(
        self, server: uvicorn.Server, client: EngineClient, loop: asyncio.AbstractEventLoop
    ) -> None:
        while not self._stopping.wait(0.2):
            failure = self._child_failure() or client.reader_failure or self._hang(client)
            if failure is not None:
                logger.error("%s; shutting the server down", failure)
                self.failure = failure
                self.exit_code = 1
                self._stopping.set()
                # answered before the server stops, which would cut their connections
                loop.call_soon_threadsafe(client.fail_all, f"the engine stopped: {failure}")
                server.should_exit = True
                return

    def _child_failure(self) -> str | None:
        for name, child in self.children.items():
            if child.exitcode is not None:
                reason = start_failure(self.endpoints, name)
                if reason:
                    return f"{name} could not start: {reason}"
                return f"{name} exited with code {child.exitcode}"
        return None

    def _hang(self, client: EngineClient) -> str | None:
        """Loading has no watchdog (a large checkpoint may take its time); a ready engine
        that has sent nothing for --watchdog-timeout seconds has hung."""
        if not client.ready.is_set():  # read first: heard_at is set before ready, never after
            return None
        silent_s = time.monotonic() - client.heard_at
        if silent_s > self.options.watchdog_timeout:
            return (
                f"the scheduler has sent nothing for {silent_s:.0f} s (--watchdog-timeout "
                f"{self.options.watchdog_timeout:g}): a step hung"
            )
        return None

    def run(self) -> int:
        self._start_children()
        try:
            asyncio.run(self._serve())
        finally:
            self._stopping.set()
            self._stop_children()
            shutil.rmtree(
                Path(self.endpoints.api_in.removeprefix("ipc://")).parent, ignore_errors=True
            )
        return self.exit_code

    async def _serve(self) -> None:
        # options made from a command line have the name (server_options); others, --model's
        name = served_model_name(self.options.served_model_name, self.config.model)
        metrics = EngineMetrics(self.config.role, name)
        metrics.set_build_info(kubesgl.__version__, name)
        async with EngineClient(self.endpoints, metrics, GcPacer()) as client:
            self._client = client
            client.start()
            state = ServerState(self.config, served_model_name=name, api_key=self.options.api_key)
            app = build_app(client, state)
            uv_config = uvicorn.Config(
                app,
                host=self.options.host,
                port=self.options.port,
                log_level=self.options.log_level,
                timeout_graceful_shutdown=5,
                timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                access_log=False,
            )
            server = _UvicornServer(uv_config)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(
                    sig, lambda: asyncio.ensure_future(self._drain(server, client, state))
                )
            threading.Thread(
                target=self._watch_children,
                args=(server, client, loop),
                name="child-watch",
                daemon=True,
            ).start()
            if self.listen_socket is not None:  # uvicorn names no address when given a socket
                host, port = self.listen_socket.getsockname()[:2]
                logger.info(
                    "HTTP API on %s (/health answers 200 once the engine is ready)",
                    contract.http_url(host, port),
                )
            await server.serve(
                sockets=[self.listen_socket] if self.listen_socket is not None else None
            )
            if not self._stopping.is_set():
                await client.shutdown()

    async def _drain(
        self, server: uvicorn.Server, client: EngineClient, state: ServerState
    ) -> None:
        if state.draining:
            return
        state.draining = True
        deadline = time.monotonic() + self.options.shutdown_timeout
        logger.info(
            "draining: %d requests in flight, %.0f s to finish",
            client.in_flight,
            self.options.shutdown_timeout,
        )
        while client.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.in_flight:
            logger.warning(
                "aborting %d requests still running at the shutdown deadline", client.in_flight
            )
            await client.abort_all("the server is shutting down")
            while client.in_flight and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.05)
        self._stopping.set()
        await client.shutdown()
        server.should_exit = True

    def _stop_children(self) -> None:
        # A child died: the rest get no Shutdown message. Or the engine never became ready: a
        # loading scheduler reads no Shutdown (nor does the bootstrap process, which only rank
        # 0 stops), and there is nothing to finish (no request was admitted, no KV is being
        # written), so waiting CHILD_STOP_S for them only delays the kill. Stop them now.
        ready = self._client is not None and self._client.ready.is_set()
        if self.exit_code != 0 or not ready:
            for child in self.children.values():
                if child.is_alive():
                    child.terminate()
        deadline = time.monotonic() + CHILD_STOP_S
        for child in self.children.values():
            child.join(timeout=max(0.1, deadline - time.monotonic()))
        for name, child in self.children.items():
            if child.is_alive():
                logger.warning("%s did not stop in time; killing it", name)
                child.kill()
                child.join()
