"""P/D mode with no prefill worker that can serve: requests go to a decode worker alone, which
prefills them itself (docs/router.md, Prefill/decode mode). Logged as it starts and ends, not
at every request: a prefill pool down for minutes would otherwise fill the log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kubesgl.router")


@dataclass
class PrefillOutages:
    # Whether a decode worker serves the model still (worker.serves).
    decode_serves: Callable[[str | None], bool]
    # The models (None: requests that name none) whose last request found no prefill worker.
    # Only models a decode worker serves are noted (the router answers others 404 first).
    _models: set[str | None] = field(default_factory=set)

    def note(self, model: str | None, why_missing: Callable[[], str] | None) -> None:
        """`why_missing`: says why no prefill worker can serve a request for `model` (asked
        only as an outage starts, not at each of its requests); None: one can."""
        if why_missing is not None and model not in self._models:
            # Models come and go (an engine restarted under another name): those no decode
            # worker serves any more are forgotten, so the set holds only models served.
            self._models = {m for m in self._models if self.decode_serves(m)}
            self._models.add(model)
            log.warning(
                "%s%s: requests go to a decode worker alone, which prefills them itself",
                why_missing(),
                _for(model),
            )
        elif why_missing is None and model in self._models:
            self._models.discard(model)
            log.info(
                "a prefill worker can serve%s again: requests are handed over again", _for(model)
            )


def _for(model: str | None) -> str:
    return "" if model is None else f" (model {model!r})"
