"""`kubesgl bench <kind> ...` (kinds: serving)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serving",):
        print("usage: kubesgl bench serving --base-url URL [options]  (see `kubesgl bench serving --help`)",
              file=sys.stderr)
        return 2
    from kubesgl.bench.serving import main as serving

    return serving(argv[1:])
