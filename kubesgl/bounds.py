"""Limits of a numeric option, shared by the engine's options (engine/config.py) and the
router's (router/options.py), which must not import each other. Imports nothing: the
torch-free operator reads both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class Limits(TypedDict):
    """Bounds as pydantic's Field takes them (keyword arguments)."""

    ge: float | None
    gt: float | None
    le: float | None
    lt: float | None


@dataclass(frozen=True)
class Bounds:
    """Limits of a number: ge/le inclusive, gt/lt exclusive (pydantic's names)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def limits(self) -> Limits:
        """The limits as pydantic's Field takes them: `Field(**bounds.limits())`."""
        return {"ge": self.ge, "gt": self.gt, "le": self.le, "lt": self.lt}

    def describe(self) -> str:
        """'at least 1', 'in (0, 1)', 'positive', ...: what a value must be."""
        if self == Bounds(ge=0):
            return "non-negative"
        if self == Bounds(gt=0):
            return "positive"
        low = (
            f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        )
        high = (
            f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        )
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"at least {self.ge}" if self.ge is not None else f"more than {self.gt}"
        return f"at most {self.le}" if self.le is not None else f"less than {self.lt}"
