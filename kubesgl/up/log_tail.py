"""Why a process that `kubesgl up` started failed, in one line read from the end of its log."""

from __future__ import annotations

import os
import re
from pathlib import Path

_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # what `hf` writes to color its lines, even into a file
# An error that ends a process is one line with what to do at its end: shown whole, unless a
# line runs on (an exception holding a large value), cut then with a mark.
LINE_MAX = 400


def last_lines(log_path: Path, start: int = 0, size: int = 4096) -> list[str]:
    """The non-empty lines, stripped and without color codes, of the last `size` bytes of the
    log written after offset `start` (a log may hold earlier runs' lines)."""
    with log_path.open("rb") as log:
        log.seek(max(start, log.seek(0, os.SEEK_END) - size))
        text = log.read().decode(errors="replace")
    lines = (_COLOR.sub("", line).strip() for line in text.splitlines())
    return [line for line in lines if line]


def clip(line: str) -> str:
    """`line`, cut to LINE_MAX characters with a mark where it runs on."""
    return line if len(line) <= LINE_MAX else line[: LINE_MAX - 1] + "…"
