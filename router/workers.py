"""The pool of workers: who they are, whether they can serve, and how loaded they are."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from kubesgl import contract
from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.security import host_problem

log = logging.getLogger("kubesgl.router")


class Role(StrEnum):
    """The engine roles the router sends requests to (kubesgl.contract names them)."""

    MIXED = contract.MIXED
    PREFILL = contract.PREFILL
    DECODE = contract.DECODE


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; rejects anything else."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    # before anything that names the URL: its password stays out of errors and logs
    if "@" in parts.netloc:
        redacted = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()
        raise ValueError(
            f"a worker URL carries no user name or password: {redacted!r} (the router sends "
            "engines its own key, from KUBESGL_API_KEY)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"not a worker URL: {url!r} (expected http://HOST:PORT or https://HOST:PORT)"
        )
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"a worker URL has no path or query: {url!r}")
    if parts.port == 0:  # reading .port also raises ValueError for a malformed port
        raise ValueError(f"a worker URL needs a real port: {url!r}")
    return url


def validate_worker_url(url: str) -> str:
    """normalize_url, and a host that is no link-local or cloud metadata address (as written:
    the admin API also checks what a name resolves to, the connection pool every connection)."""
    url = normalize_url(url)
    host = urlsplit(url).hostname or ""
    problem = host_problem(host)
    if problem is not None:
        raise ValueError(
            f"worker URL {url!r}: {host} is {problem}; the router never sends requests there"
        )
    return url


DISCOVERED = "kubernetes"  # a worker's source when pod discovery added it


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    breaker: CircuitBreaker
    bootstrap_port: int | None = None  # prefill workers only
    source: str = "static"  # static | admin | kubernetes
    pod: str = ""  # the pod's name, when discovery found the worker
    # the ids of its /v1/models (a vLLM engine may serve several names), once a health check
    # has asked; empty before
    models: tuple[str, ...] = ()
    # a prefill or decode engine's KV layout fingerprint (contract.KV_LAYOUT_HEADER), as its
    # last passed health check told it; None: not told (SGLang's engines), which pairs with any
    kv_layout: str | None = None
    healthy: bool = False  # false until the first health check passes
    in_flight: int = 0
    health_failures: int = 0  # consecutive failed health checks
    health_successes: int = 0  # consecutive passed health checks
    lost: bool = False  # out of the pool since its connection broke: maybe a restart to come

    @property
    def host(self) -> str:
        """The address a decode engine uses to reach this worker's bootstrap server."""
        return urlsplit(self.url).hostname or ""

    @property
    def model_name(self) -> str:
        """The model it serves, its first id (kubesgl_router_worker_info's label)."""
        return self.models[0] if self.models else ""

    def can_serve(self) -> bool:
        return self.healthy and self.breaker.allows_requests()

    @property
    def unchecked(self) -> bool:
        """Out of the pool, no health check of it having ended yet: new."""
        return not (self.healthy or self.lost or self.health_failures or self.health_successes)

    @property
    def returning(self) -> bool:
        """Out of the pool, its last checks passed, fewer than --health-success-threshold."""
        return not self.healthy and self.health_successes > 0

    def serves(self, model: str | None) -> bool:
        """Whether a request for `model` (None: a request that names none) may come here. One
        that has not named its models yet may serve any: its engine refuses another itself."""
        return model is None or not self.models or model in self.models

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "source": self.source,
            "pod": self.pod,
            "model_name": self.model_name,
            "kv_layout": self.kv_layout,
            "healthy": self.healthy,
            "circuit": self.breaker.state.value,
            "in_flight": self.in_flight,
        }


@dataclass
class WorkerRegistry:
    """Workers by URL."""

    make_breaker: Callable[[], CircuitBreaker] = CircuitBreaker
    _workers: dict[str, Worker] = field(default_factory=dict)
    _on_added: list[Callable[[Worker], object]] = field(default_factory=list)
    _on_removed: list[Callable[[Worker], None]] = field(default_factory=list)
    _on_restarted: list[Callable[[Worker], None]] = field(default_factory=list)

    def on_added(self, callback: Callable[[Worker], object]) -> None:
        self._on_added.append(callback)

    def on_removed(self, callback: Callable[[Worker], None]) -> None:
        self._on_removed.append(callback)

    def on_restarted(self, callback: Callable[[Worker], None]) -> None:
        """`callback(worker)` when a worker comes back as a restarted process (`set_healthy`)."""
        self._on_restarted.append(callback)

    def add(
        self,
        url: str,
        role: Role,
        bootstrap_port: int | None = None,
        source: str = "static",
        pod: str = "",
    ) -> Worker:
        """Adds a worker, or replaces one with the same URL whose role or port changed; ValueError
        for a URL the router refuses (validate_worker_url)."""
        url = validate_worker_url(url)
        if role is Role.PREFILL and bootstrap_port is None:
            bootstrap_port = contract.BOOTSTRAP_PORT  # the engine's default
        if role is not Role.PREFILL:
            bootstrap_port = None
        existing = self._workers.get(url)
        if existing is not None:
            if existing.role is role and existing.bootstrap_port == bootstrap_port:
                if existing.source == source:  # a new pod at a gone pod's address owns it now
                    existing.pod = pod or existing.pod
                return existing
            self.remove(url)
        worker = Worker(url, role, self.make_breaker(), bootstrap_port, source, pod)
        self._workers[url] = worker
        log.info("worker added: %s (%s, from %s)", url, role.value, source)
        for callback in self._on_added:
            callback(worker)
        return worker

    def remove(self, url: str, pod: str | None = None) -> Worker | None:
        """Removes the worker at `url`; with `pod`, only if discovery added it for that pod
        (another pod may have its address now, or a static worker may share it)."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None or (pod is not None and (worker.source, worker.pod) != (DISCOVERED, pod)):
            return None
        del self._workers[url]
        log.info("worker removed: %s", worker.url)
        for callback in self._on_removed:
            callback(worker)
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_url(url))

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def with_role(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role is role]

    def available(self, role: Role, model: str | None = None) -> list[Worker]:
        return [
            w
            for w in self._workers.values()
            if w.role is role and w.can_serve() and w.serves(model)
        ]

    def is_disaggregated(self) -> bool:
        """P/D mode once any prefill or decode worker is registered, unless mixed workers can
        serve and no prefill/decode pair can yet: a switch between modes, where the new pool's
        pods join one by one, and the old pool serves until it goes."""
        if all(w.role is Role.MIXED for w in self._workers.values()):
            return False
        pair = bool(self.available(Role.PREFILL) and self.available(Role.DECODE))
        return pair or not self.available(Role.MIXED)

    def set_healthy(self, worker: Worker, healthy: bool, reason: str = "") -> None:
        """A worker that left the pool because its connection broke and passes health checks
        again gets a new, closed circuit breaker: it is most likely a restarted process, and
        the failures of the requests its crash cut must not keep it out, and what was learned
        of its old process (its KV cache's prefixes: `on_restarted`) is forgotten. (One that
        only failed health checks, slow under load say, keeps its breaker.) Requests still
        running from before report to the breaker they started with."""
        if worker.healthy != healthy:
            worker.healthy = healthy
            if healthy and worker.lost:
                worker.lost = False
                if worker.breaker.consecutive_failures:
                    reset = (
                        f"its circuit breaker ({worker.breaker.state.value}, "
                        f"{worker.breaker.consecutive_failures} failed requests) is reset"
                    )
                    reason = f"{reason}; {reset}" if reason else reset
                worker.breaker = self.make_breaker()
                for callback in self._on_restarted:
                    callback(worker)
            level = logging.INFO if healthy else logging.WARNING
            log.log(
                level,
                "worker %s is now %s%s",
                worker.url,
                "healthy" if healthy else "unhealthy",
                f": {reason}" if reason else "",
            )

    def mark_lost(self, worker: Worker) -> None:
        """A connection to it was refused, reset or closed: out of the pool until health checks
        pass again."""
        if self._workers.get(worker.url) is worker:
            worker.health_successes = 0
            worker.lost = True
            self.set_healthy(worker, False, "a connection to it was refused, reset or closed")
