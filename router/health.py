"""Periodic health checks: workers leave the pool when /health fails and return when it passes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

import aiohttp

from kubesgl.contract import KV_LAYOUT_HEADER
from kubesgl.router.options import check_bounds, option
from kubesgl.router.workers import Worker, WorkerRegistry

log = logging.getLogger("kubesgl.router")
MODELS_PATH = "/v1/models"
_TIMING_ERROR = "health check interval and timeout must be positive"
_THRESHOLD_ERROR = "health check thresholds must be at least 1"


@dataclass(frozen=True, kw_only=True)  # keywords only: two floats swapped would type-check
class HealthSettings:
    interval_s: float = option(
        5.0,
        flag="--health-check-interval",
        help="seconds between two health checks of a worker",
        error=_TIMING_ERROR,
        gt=0,
    )
    timeout_s: float = option(
        3.0,
        flag="--health-check-timeout",
        help="seconds a health check may take before it counts as failed",
        error=_TIMING_ERROR,
        gt=0,
    )
    failure_threshold: int = option(
        2,
        flag="--health-failure-threshold",
        help="consecutive failed checks before a worker leaves the pool",
        error=_THRESHOLD_ERROR,
        ge=1,
    )
    success_threshold: int = option(
        1,
        flag="--health-success-threshold",
        help="consecutive passed checks before it comes back",
        error=_THRESHOLD_ERROR,
        ge=1,
    )
    path: str = "/health"

    def __post_init__(self) -> None:
        check_bounds(self)


class HealthChecker:
    def __init__(
        self,
        workers: WorkerRegistry,
        session: aiohttp.ClientSession,
        settings: HealthSettings,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.workers = workers
        self.session = session
        self.settings = settings
        # The router's key: engines answer /health without one today, but a probe must not fail
        # (and take every worker out) the day they ask for it. It goes only where requests go.
        self.headers = headers or {}
        # The check in flight of each worker: one at a time, as two at once would count one
        # moment of passing as two passed checks.
        self._probes: dict[Worker, asyncio.Task[None]] = {}
        # A new worker is probed at once instead of waiting up to a full interval.
        workers.on_added(self.probe_soon)

    async def run(self) -> None:
        """The checks after the first round (`check_all`, which start-up awaits)."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        # a check in flight (a new worker's, or one the signal asked for) is this round's
        await asyncio.gather(*(self.probe_soon(w) for w in self.workers.all()))

    def check_out_of_pool(self) -> None:
        """Checks now every worker out of the pool (contract.ROUTER_CHECK_SIGNAL): whoever
        restarted an engine knows when it is ready, up to an interval before the next check.
        Those in the pool wait for theirs: their failures must not count twice as fast."""
        for worker in self.workers.all():
            if worker.healthy:
                continue
            running = self._probes.get(worker)
            if running is None:
                self.probe_soon(worker)
            else:  # it may have asked before the engine was ready: once more after it
                running.add_done_callback(partial(self._probe_again, worker))

    def _probe_again(self, worker: Worker, done: asyncio.Task[None]) -> None:
        if not (done.cancelled() or worker.healthy) and self.workers.get(worker.url) is worker:
            self.probe_soon(worker)

    def probe_soon(self, worker: Worker) -> asyncio.Task[None]:
        """The worker's check in flight, or a new one."""
        task = self._probes.get(worker)
        if task is None:
            task = asyncio.get_running_loop().create_task(self.check(worker))
            self._probes[worker] = task
            task.add_done_callback(lambda _: self._probes.pop(worker, None))
        return task

    async def check(self, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        kv_layout: str | None = None
        try:
            async with self.session.get(
                worker.url + self.settings.path, timeout=timeout, headers=self.headers
            ) as response:
                await response.read()
                passed = response.status == 200
                kv_layout = response.headers.get(KV_LAYOUT_HEADER) or None
                problem = f"GET {self.settings.path} answered {response.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("health check of %s failed: %r", worker.url, exc)
            passed = False
            problem = f"GET {self.settings.path} failed: {type(exc).__name__}{f': {exc}' if str(exc) else ''}"
        # Asked again whenever it comes back to the pool: a restarted engine may serve another
        # name, and requests are routed by it
        if passed and not (worker.models and worker.healthy):
            await self._ask_model(worker)
        if self.workers.get(worker.url) is not worker:
            return  # removed (or replaced) while the check was running
        if passed:
            # before it joins the pool: a restarted engine's layout may have changed
            worker.kv_layout = kv_layout
            worker.health_failures = 0
            worker.health_successes += 1
            if worker.health_successes >= self.settings.success_threshold:
                self.workers.set_healthy(worker, True)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.health_failures >= self.settings.failure_threshold:
                self.workers.set_healthy(
                    worker,
                    False,
                    f"{worker.health_failures} failed health checks, the last: {problem}",
                )

    async def _ask_model(self, worker: Worker) -> None:
        """The models a worker serves, for routing and kubesgl_router_worker_info, asked before
        it joins the pool. One that does not answer joins all the same (it may serve any model)
        and is asked again at its next check."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            async with self.session.get(
                worker.url + MODELS_PATH, timeout=timeout, headers=self.headers
            ) as response:
                models = (
                    (await response.json(content_type=None)).get("data")
                    if response.status == 200
                    else None
                )
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
            log.debug("GET %s of %s failed: %r", MODELS_PATH, worker.url, exc)
            return
        if isinstance(models, list):
            ids = (m.get("id") for m in models if isinstance(m, dict))
            worker.models = tuple(str(i) for i in ids if i)

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
