"""Full garbage collections kept off the serving path.

CPython's full (generation 2) collection stops the process while it walks every object it
tracks. A serving process holds hundreds of thousands of them from start-up alone (torch,
the model's modules, a tokenizer): a pass took 185 ms on a 2-core machine with only the tiny
model loaded, and under load, with requests and radix-cache nodes living long enough to reach
the old generation, a busy scheduler loop ran 15 to 22 of them a minute, up to 450 ms each
(benchmarks/README.md, "Garbage collection"). Each is a stall of every running request; with
tensor parallelism, of every rank. So each serving process:

- freezes what start-up left alive (`gc.freeze`, as SGLang and vLLM do): the collector never
  walks it again;
- turns automatic full collections off, keeping the frequent young-generation ones, which
  free short-lived cycles at a fraction of a millisecond;
- runs a full collection itself once it has been idle for `idle_after_s` (it waits for work
  anyway), and at most every `busy_every_s` under sustained load, so that cycles which
  reached the old generation are still freed.

(In CPython 3.11 and 3.12 a full collection is due once the third threshold's number of
generation-1 collections have run since the last one; a threshold that is never reached
turns them off. The package supports no other versions.)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_NEVER = 1 << 30  # generation-1 collections before an automatic full one: never, in practice
TICK_S = 1.0  # how often `tick_every` tells a pacer whether its process is busy


class GcPacer:
    def __init__(
        self,
        idle_after_s: float = 1.0,
        busy_every_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.idle_after_s = idle_after_s
        self.busy_every_s = busy_every_s
        self.clock = clock
        self._last_full = clock()
        self._idle_since: float | None = None
        self._collected_while_idle = False

    def start(self) -> None:
        """Call once start-up is done (model loaded, warmed up), before serving."""
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
        self._last_full = self.clock()
        logger.debug("froze %d objects out of the garbage collector's reach", gc.get_freeze_count())

    def due(self, busy: bool) -> bool:
        """Whether a full collection is due now. Call on every turn of the process's loop (a
        turn at least every few seconds while idle), saying whether it has work in flight."""
        now = self.clock()
        if busy:
            self._idle_since = None
            self._collected_while_idle = False
            return now - self._last_full >= self.busy_every_s
        if self._idle_since is None:
            self._idle_since = now
        if self._collected_while_idle or now - self._idle_since < self.idle_after_s:
            return False
        self._collected_while_idle = True
        return True

    def collect(self) -> None:
        gc.collect()
        self._last_full = self.clock()

    def tick(self, busy: bool) -> None:
        """`due`, then `collect` if it is."""
        if self.due(busy):
            self.collect()


async def tick_every(pacer: GcPacer, busy: Callable[[], bool]) -> None:
    """An asyncio process's turns: `pacer.tick(busy())` every TICK_S, until cancelled."""
    while True:
        await asyncio.sleep(TICK_S)
        pacer.tick(busy())
