"""Drift: does a live object still hold every field the operator applies?

Live objects carry more than was applied (defaults, status, other managers' fields), so the
check is containment, not equality. The API server rewrites quantities ("0.5" into "500m",
"1.5Gi" into "1536Mi", "1000" into "1k") in the fields of a quantity type, which is not drift
either: those under `_QUANTITY_FIELDS`. Nor is an empty string or list that the live object
leaves out: the API server drops those of its `omitempty` fields (an env variable's value, a
toleration's key, an affinity's list of preferences), and those it keeps are compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

# containers' resources, an emptyDir's sizeLimit, an HPA metric's target (value, averageValue),
# an env variable's resourceFieldRef divisor (spec.ROLE.env, passed on as given)
_QUANTITY_FIELDS = frozenset({"resources", "sizeLimit", "target", "divisor"})


def has_drifted(desired: Any, live: Any) -> bool:
    return not _contains(live, desired, quantities=False)


def _contains(live: Any, desired: Any, quantities: bool) -> bool:
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            _contains(live[key], value, quantities or key in _QUANTITY_FIELDS)
            if key in live
            else value in ("", [])
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(_contains(have, want, quantities) for have, want in zip(live, desired))
        )
    if live == desired and type(live) is type(desired):
        return True
    return quantities and _same_quantity(live, desired)


def _same_quantity(live: Any, desired: Any) -> bool:
    try:
        return parse_quantity(live) == parse_quantity(desired)
    except (ValueError, TypeError):
        return False
