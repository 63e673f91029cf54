"""P/D mode: a decode worker is paired only with prefill workers whose KV pool it can take
writes from (docs/router.md, Prefill/decode mode). A prefill engine refuses a decode engine of
another pool layout (another model shape, KV element type or tensor-parallel size) with a 502;
while a rollout changing one of them replaces the prefill and decode pools independently, the
router would otherwise pair old with new for the whole rollout.

Each prefill and decode engine names its layout's fingerprint in a header of its /health
answer (contract.KV_LAYOUT_HEADER); the health checks keep it on the worker. A decode worker
none of whose prefill workers shares its fingerprint serves its requests alone, prefilling
them itself: logged as that starts and ends, not at every request."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kubesgl.contract import kv_layouts_pair
from kubesgl.router.workers import Worker

log = logging.getLogger("kubesgl.router")


@dataclass
class LayoutPairing:
    # The KV layouts the registered decode workers have now.
    decode_layouts: Callable[[], set[str | None]]
    # (model, a decode layout) whose last request found prefill workers, none of that layout
    _unpaired: set[tuple[str | None, str]] = field(default_factory=set)

    def prefills_for(
        self, decode: Worker, prefills: list[Worker], model: str | None, note: bool = True
    ) -> list[Worker]:
        """The prefill workers of `prefills` that `decode` pairs with: those of its layout, and
        any where either side has not named one. `note`: whether the answer tells how the pool
        is now (a request's first attempt; a retry's `prefills` lack those that failed it)."""
        paired = [w for w in prefills if kv_layouts_pair(w.kv_layout, decode.kv_layout)]
        if not note or not prefills or decode.kv_layout is None:
            return paired  # no prefill worker at all is PrefillOutages' to tell
        key = (model, decode.kv_layout)
        if not paired and key not in self._unpaired:
            # Layouts no decode worker has any more are forgotten: the set stays small.
            layouts = self.decode_layouts()
            self._unpaired = {k for k in self._unpaired if k[1] in layouts}
            self._unpaired.add(key)
            theirs = sorted({w.kv_layout or "unknown" for w in prefills})
            log.warning(
                "no prefill worker that can serve%s has the KV layout %s of decode worker %s "
                "(theirs: %s): requests go to the decode workers of that layout alone, which "
                "prefill them itself, until one has (a rollout of another model, dtype, KV "
                "cache dtype or tensor-parallel size under way?)",
                _for(model),
                decode.kv_layout,
                decode.url,
                ", ".join(theirs),
            )
        elif paired and key in self._unpaired:
            self._unpaired.discard(key)
            log.info(
                "a prefill worker of KV layout %s can serve%s again: requests are handed over "
                "again",
                decode.kv_layout,
                _for(model),
            )
        return paired


def _for(model: str | None) -> str:
    return "" if model is None else f" (model {model!r})"
