"""Launching steps: either in line (`SyncExecutor`) or on a worker thread (`OverlapExecutor`)
so that the scheduler prepares step N+1 while step N runs. Steps always run in launch
order, one at a time, which is what makes the future-token hand-off and KV reuse safe.
A launch resolves to a PendingStep; its `wait` gives the tokens."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from kubesgl.engine.executor.model_runner import ModelRunner, PendingStep
from kubesgl.engine.forward_batch import ForwardBatch


class SyncExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def launch(self, batch: ForwardBatch) -> Future[PendingStep]:
        future: Future[PendingStep] = Future()
        try:
            future.set_result(self.runner.run(batch))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the step
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        del self.runner  # the model, the KV pool and the CUDA graphs: their memory may go


class OverlapExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._queue: queue.Queue[tuple[ForwardBatch, Future[PendingStep]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kubesgl-executor", daemon=True)
        self._thread.start()

    def launch(self, batch: ForwardBatch) -> Future[PendingStep]:
        future: Future[PendingStep] = Future()
        self._queue.put((batch, future))
        return future

    def _loop(self) -> None:
        import torch

        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)
        while (item := self._queue.get()) is not None:
            batch, future = item
            try:
                future.set_result(self.runner.run(batch))
            except BaseException as exc:  # noqa: BLE001 - handed to the scheduler
                future.set_exception(exc)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()
        del self.runner  # the model, the KV pool and the CUDA graphs: their memory may go
