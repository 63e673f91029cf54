"""`kubesgl bench <kind> ...` (kinds: serving)."""

from __future__ import annotations

import sys

BENCHMARKS = ("serving",)
USAGE = """usage: kubesgl bench serving --base-url URL [options]

  serving  drive a server with a request set and report latencies and throughputs

Run `kubesgl bench serving --help` for its options."""


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] not in BENCHMARKS:  # named, as `kubesgl` names an unknown command
        print(f"kubesgl bench: unknown benchmark {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from kubesgl.bench.serving import main as serving

    return serving(argv[1:])
