"""Every numeric router option is declared once, on the settings field it sets
(router/options.py): its flag on the command line, its limits in the settings' checks, and
the operator's spec.router field named like it, must each agree with that declaration."""

from __future__ import annotations

import re

import pytest

from kubesgl.bounds import Bounds
from kubesgl.contract import ADMIN_KEY_ENV
from kubesgl.router.cli import build_parser, config_from_args
from kubesgl.router.config import ROUTER_OPTIONS
from kubesgl.router.options import RouterOption

OPTIONS = list(ROUTER_OPTIONS.values())
ADMIN = {ADMIN_KEY_ENV: "adm"}  # a router without workers takes this or refuses to start


def _just_outside(bounds: Bounds, step: float) -> list[float]:
    """For each limit, the value nearest to it that it excludes."""
    limits = [(bounds.ge, -step), (bounds.gt, 0), (bounds.le, step), (bounds.lt, 0)]
    return [limit + offset for limit, offset in limits if limit is not None]


def _edges(bounds: Bounds) -> list[float]:
    return [limit for limit in (bounds.ge, bounds.le) if limit is not None]


def _config(opt: RouterOption, value: float):
    return config_from_args(build_parser().parse_args([f"{opt.flag}={opt.type(value)}"]), ADMIN)


def test_every_numeric_flag_is_a_declared_option():
    parser = build_parser()
    numeric = {flag for a in parser._actions if a.type in (int, float) for flag in a.option_strings}
    assert numeric == set(ROUTER_OPTIONS)


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda opt: opt.flag)
def test_a_value_beyond_the_bounds_is_refused_with_the_declared_error(opt):
    assert opt.bounds != Bounds(), f"{opt.flag}: no limits declared"
    assert opt.bounds.holds(opt.default)
    for value in _just_outside(opt.bounds, step=1 if opt.type is int else 1e-6):
        with pytest.raises(ValueError, match=f"^{re.escape(opt.error)}$"):
            _config(opt, value)
    for value in _edges(opt.bounds):
        _config(opt, value)
