"""What every child process of the server does at start."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from kubesgl.engine.ipc import Endpoints


def exit_with_parent() -> None:
    """End this process when the process that started it goes away (no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _failure_file(endpoints: Endpoints, name: str) -> Path:
    folder = Path(endpoints.api_in.removeprefix("ipc://")).parent
    return folder / f"failed-{name.replace(' ', '-')}"


def start_failure_line(exc: BaseException) -> str:
    """An engine that could not start, in one line: the exception's first, named by its type
    where it is not one of the errors the engine raises itself."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not isinstance(exc, (ValueError, OSError, RuntimeError, ImportError)):
        message = f"{type(exc).__name__}: {message}"
    return message


def exit_for_start_failure(endpoints: Endpoints, name: str, exc: BaseException) -> NoReturn:
    """A child that could not start: one line naming the problem (the traceback only at
    --log-level debug), left for the server to repeat as its last line, and exit status 1."""
    message = start_failure_line(exc)
    logger = logging.getLogger("kubesgl.serve")
    logger.error("%s could not start: %s", name, message)
    logger.debug("%s could not start", name, exc_info=exc)
    try:
        _failure_file(endpoints, name).write_text(message)
    except OSError:
        pass
    logging.shutdown()
    sys.stderr.flush()
    os._exit(
        1
    )  # at once: unwinding torch and the rest at exit takes seconds, and there is nothing to keep


def start_failure(endpoints: Endpoints, name: str) -> str | None:
    """What a child that exited reported with exit_for_start_failure, if it did."""
    try:
        return _failure_file(endpoints, name).read_text()
    except OSError:
        return None
