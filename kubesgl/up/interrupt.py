"""How `kubesgl up` stops before its supervisor runs: SIGINT or SIGTERM ends it at once, quietly,
with status 130 (the supervisor then takes either as its drain). Kept free of imports, so that
`kubesgl` sets it before it imports the rest of `up`, which takes a second or more."""

from __future__ import annotations

import signal
from types import FrameType

INTERRUPTED = 130  # the exit status of a Ctrl-C before any process runs, as a shell's


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from now on, SIGINT also where it was ignored:
    a shell starts a script's background job with SIGINT ignored, and `kubesgl up` takes SIGINT
    as its stop once its processes run anyway, so a `kill -INT` in its first seconds (its
    imports, the model step) was lost and it went on to start everything."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
