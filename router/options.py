"""Router options: each numeric option of `kubesgl router` is declared once, on the settings
field it sets (CacheAwareSettings, DisaggregationSettings, HealthSettings, RetrySettings and
RouterConfig's own): its flag, help text, default, limits and the error for a value beyond
them. The command line (cli.py), the settings' checks, and the limits and render of the
operator's spec.router fields named like the flags derive from these declarations; the CRD's
limits are checked against them (tests/unit/test_router_options.py).

This module imports nothing of the router: the settings' modules import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from kubesgl.bounds import Bounds

_OPTION = "kubesgl.router.option"  # the key of an option's declaration in a field's metadata


@dataclass(frozen=True)
class _Declared:
    flag: str
    help: str
    default: int | float
    bounds: Bounds
    error: str


def option(
    default: int | float,
    *,
    flag: str,
    help: str,
    error: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A settings field that is a router option: `error` is the settings' ValueError for a
    value beyond the bounds (several fields may share one)."""
    declared = _Declared(flag, help, default, Bounds(ge, gt, le, lt), error)
    return field(default=default, metadata={_OPTION: declared})


@dataclass(frozen=True)
class RouterOption:
    """One declared settings field as the command line and the operator see it."""

    name: str  # of the settings field
    flag: str
    type: type  # int or float
    default: int | float
    help: str
    bounds: Bounds
    error: str

    @property
    def dest(self) -> str:
        """The flag's attribute in parsed arguments, and the name of its spec.router field."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def metavar(self) -> str:
        if self.name.endswith("_s"):
            return "S"  # seconds
        return "N" if self.type is int else "X"


def _option(f: dataclasses.Field, value_type: type) -> RouterOption:
    declared: _Declared = f.metadata[_OPTION]
    return RouterOption(
        f.name,
        declared.flag,
        value_type,
        declared.default,
        declared.help,
        declared.bounds,
        declared.error,
    )


def options_of(settings: type) -> tuple[RouterOption, ...]:
    """The declared options of a settings class, in field order."""
    hints = typing.get_type_hints(settings)
    return tuple(
        _option(f, hints[f.name]) for f in dataclasses.fields(settings) if _OPTION in f.metadata
    )


def check_bounds(settings: Any) -> None:
    """Raises the declared error of the first option of `settings` beyond its bounds."""
    for opt in options_of(type(settings)):
        if not opt.bounds.holds(getattr(settings, opt.name)):
            raise ValueError(opt.error)


def add_options(group: argparse._ArgumentGroup, options: typing.Iterable[RouterOption]) -> None:
    for opt in options:
        group.add_argument(
            opt.flag, type=opt.type, default=opt.default, metavar=opt.metavar, help=opt.help
        )


def values_from_args(settings: type, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `settings` that the command line gave (or defaulted)."""
    return {opt.name: getattr(args, opt.dest) for opt in options_of(settings)}
