"""How many output tokens admission reserves KV for: an estimate, measured on the requests
that finished here, instead of max_tokens (or --default-max-tokens, 4096, for a request that
sets none), which holds most of a pool empty for outputs that never come.

A request whose outputs outgrow the estimate takes pages nobody has reserved; when there
are none, the scheduler retracts requests (scheduler.py) and this estimate backs off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class OutputEstimate:
    """The share of its remaining max_tokens a request is expected to generate."""

    ratio: float = 0.5  # before any request finished: half of max_tokens
    # never below: a burst of long answers after short ones must not retract everything
    floor: float = 0.05
    weight: float = 0.1  # of each finished request in the moving average
    backoff: float = 1.5  # the ratio's growth on each shortage that retracts requests

    def outputs(self, remaining: int) -> int:
        """Output tokens to reserve for a request that may still generate `remaining`."""
        return max(1, min(remaining, math.ceil(self.ratio * remaining)))

    def finished(self, generated: int, allowed: int) -> None:
        """A request ended after `generated` of its `allowed` (max_tokens) outputs."""
        # one allowed token (a /health_generate probe) is always generated: no sign of how long
        # answers run, and such a request reserves one token whatever the estimate
        if allowed > 1:
            observed = min(1.0, generated / allowed)
            self.ratio = max(self.floor, (1 - self.weight) * self.ratio + self.weight * observed)

    def retracted(self) -> None:
        """A decode step found too few pages and requests were retracted (once per shortage)."""
        self.ratio = min(1.0, self.ratio * self.backoff)
