"""`kubesgl bench <kind> ...` (kinds: serving)."""

from __future__ import annotations

import sys

USAGE = """usage: kubesgl bench serving --base-url URL [options]

  serving  drive a server with a request set and report latencies and throughputs

Run `kubesgl bench serving --help` for its options."""


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in ("serving",):
        print(USAGE, file=sys.stderr)
        return 2
    from kubesgl.bench.serving import main as serving

    return serving(argv[1:])
