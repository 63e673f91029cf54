"""What the benchmark scripts share: printing and saving a result as JSON."""

from __future__ import annotations

import json


def report(result: dict, out: str | None) -> None:
    """Print `result` as JSON and, when `out` is given, write it there too."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
