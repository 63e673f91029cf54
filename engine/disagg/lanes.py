"""Work for many addresses on one bounded pool of threads, at most a few at a time for any one
address: a peer that hangs (a connect that times out, an accept that stalls) holds its own
share of the threads, never those of the work for the others. Its work beyond that share
waits in its lane, in order, holding no thread."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

T = TypeVar("T")


@dataclass
class _Lane:
    running: int = 0  # this address's tasks on the pool's threads
    waiting: deque[tuple[Future, Callable[[], None]]] = field(default_factory=deque)


class AddressLanes:
    def __init__(self, workers: int, per_address: int, name: str):
        if not 0 < per_address < workers:
            raise ValueError(
                f"{per_address} threads per address of {workers} leaves none for the others"
            )
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._per_address = per_address
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}  # addresses with work running or waiting
        self._closed = False

    def submit(self, address: str, work: Callable[..., T], *args: object) -> Future[T]:
        """Runs `work(*args)` once a thread and the address's share allow. After `close`,
        nothing runs: the future comes back cancelled."""
        future: Future[T] = Future()
        task = partial(self._run, address, future, work, args)
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            lane = self._lanes.setdefault(address, _Lane())
            if lane.running < self._per_address:
                lane.running += 1
                self._pool.submit(task)
            else:
                lane.waiting.append((future, task))
        return future

    def _run(
        self, address: str, future: Future[T], work: Callable[..., T], args: tuple[object, ...]
    ) -> None:
        try:
            if self._closed:  # queued before `close`: it never runs, and says so
                future.cancel()
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(work(*args))
                except BaseException as exc:  # as ThreadPoolExecutor: the future carries it
                    future.set_exception(exc)
        finally:
            self._pass_on(address)

    def _pass_on(self, address: str) -> None:
        """The finished task's place in its lane goes to the lane's next, if any."""
        with self._lock:
            lane = self._lanes[address]
            if lane.waiting:  # none once closed
                _, task = lane.waiting.popleft()
                self._pool.submit(task)
                return
            lane.running -= 1
            if not lane.running:
                del self._lanes[address]

    def close(self) -> None:
        """Work not started never runs, its future cancelled (whoever waits on it is let go);
        work running is not waited for."""
        with self._lock:
            self._closed = True
            waiting = [future for lane in self._lanes.values() for future, _ in lane.waiting]
            for lane in self._lanes.values():
                lane.waiting.clear()
        for future in waiting:
            future.cancel()
        self._pool.shutdown(wait=False)  # what it queued still runs: to cancel its future
