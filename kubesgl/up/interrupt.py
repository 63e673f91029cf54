"""How `kubesgl up` stops before its supervisor runs: SIGINT or SIGTERM ends it at once, quietly,
with status 130 (the supervisor then takes either as its drain). Kept free of imports, so that
`kubesgl` sets it before it imports the rest of `up`, which takes a second or more."""

from __future__ import annotations

import signal
import time
from types import FrameType

INTERRUPTED = 130  # the exit status of a Ctrl-C before any process runs, as a shell's
# A signal this soon after the one that stopped `kubesgl up` is the same stop, not a second
# Ctrl-C: a signal sent to a process and then to its process group reaches it twice, a few
# milliseconds apart (`timeout -s INT 25 kubesgl up ...` does so; coreutils' timeout signals its
# child, then the group). A person's second Ctrl-C comes later than this.
DUPLICATE_SIGNAL_WINDOW_S = 0.5
_raised_at: float | None = None  # when _interrupt last raised KeyboardInterrupt


def repeats(first_at: float | None) -> bool:
    """Whether a signal now is the one that came at `first_at` (None: none came) again."""
    return first_at is not None and time.monotonic() - first_at < DUPLICATE_SIGNAL_WINDOW_S


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from now on, SIGINT also where it was ignored:
    a shell starts a script's background job with SIGINT ignored, and `kubesgl up` takes SIGINT
    as its stop once its processes run anyway, so a `kill -INT` in its first seconds (its
    imports, the model step) was lost and it went on to start everything."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """KeyboardInterrupt, but not again for the same stop sent twice (it would break into the
    handling of the first, with a traceback)."""
    global _raised_at
    if repeats(_raised_at):
        return
    _raised_at = time.monotonic()
    raise KeyboardInterrupt
