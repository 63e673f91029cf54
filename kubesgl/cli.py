"""The `kubesgl` command: dispatches to the subcommand of each component.

Subcommands are imported lazily so that, for example, `kubesgl render` works where torch
is not installed. Each entry names a module exposing `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from typing import NoReturn

import kubesgl
from kubesgl.up.interrupt import INTERRUPTED, stop_on_signals

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kubesgl.engine.server.cli", "run an engine: OpenAI-compatible server"),
    "generate": ("kubesgl.engine.cli", "offline generation from a prompt (no server)"),
    "make-tiny-model": ("kubesgl.engine.models.tiny", "write a small random model for tests"),
    "router": ("kubesgl.router.cli", "run the cache-aware router"),
    "operator": ("kubesgl.operator.cli", "run the Kubernetes operator"),
    "render": ("kubesgl.operator.render_cli", "print the objects an InferenceService becomes"),
    "up": (
        "kubesgl.up.cli",
        "run an InferenceService on this machine (engines and router as processes)",
    ),
    "bench": ("kubesgl.bench.cli", "benchmarks (bench serving ...)"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"kubesgl {kubesgl.__version__}", "", "usage: kubesgl <command> [options]", ""]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += [
        "",
        "Run `kubesgl <command> --help` for the options of one command. To start: `kubesgl up -f",
        "examples/quickstart.yaml` runs a prefill/decode service on this machine's CPU (docs/up.md).",
    ]
    return "\n".join(lines)


def run() -> NoReturn:
    """The `kubesgl` command (pyproject.toml) and `python -m kubesgl`: `main`'s status as the
    process's. An interrupted run ends at once with 130: CPython 3.11 can turn a
    KeyboardInterrupt that was handled into a death by SIGINT at exit (status -2, nothing
    printed), seen when the signal came while `kubesgl up` was still importing."""
    status = main()
    if status == INTERRUPTED:
        with contextlib.suppress(OSError):  # stdout is flushed by main; stderr may be gone
            sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(sys.argv[1:] if argv is None else argv)
        finally:  # an argparse exit too: what is still buffered goes now, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        # `kubesgl -h | head -3`, `kubesgl render ... | head`: the reader has gone, which is no
        # error of ours
        return _reader_gone()


def _dispatch(argv: list[str]) -> int:
    """Runs the command ARGV names; its status."""
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(kubesgl.__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"kubesgl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[name]
    if name == "up":
        stop_on_signals()  # from its first moment, its imports included: kubesgl/up/interrupt.py
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        return INTERRUPTED  # Ctrl-C while the command loads: it has done nothing, no traceback
    except ModuleNotFoundError as exc:
        if not exc.name or not module_name.startswith(exc.name):
            raise
        print(f"kubesgl: command {name!r} is not available in this build", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


def _reader_gone() -> int:
    """Standard output's reader closed it: no traceback, and none at exit either (Python flushes
    stdout then), and the status of a process ended by SIGPIPE, as other command-line tools."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
