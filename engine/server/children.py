"""What every child process of the server does at start."""

from __future__ import annotations

import os
import signal
import threading
import time


def exit_with_parent() -> None:
    """End this process when the process that started it goes away (no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
