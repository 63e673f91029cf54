"""Every numeric router option is declared once, on the settings field it sets
(router/options.py): its flag on the command line, its limits in the settings' checks, the
CRD's spec.router field named like it, the operator's render and the option tables of
docs/router.md must each agree with that declaration."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest
import yaml
from pydantic.alias_generators import to_camel

from kubesgl.bounds import Bounds
from kubesgl.contract import ADMIN_KEY_ENV
from kubesgl.operator.render import render
from kubesgl.operator.spec import RouterSpec
from kubesgl.operator.validation import parse_inference_service
from kubesgl.router.cli import build_parser, config_from_args
from kubesgl.router.config import ROUTER_OPTIONS
from kubesgl.router.options import RouterOption

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = list(ROUTER_OPTIONS.values())
SPEC_OPTIONS = [opt for opt in OPTIONS if opt.dest in RouterSpec.model_fields]
# A value other than the default for each router option of spec.router, to follow it into the pod
CRD_SAMPLES = {
    "cacheThreshold": 0.5,
    "balanceAbsThreshold": 7,
    "balanceRelThreshold": 2.5,
    "pdMinPrefillTokens": 0,
}
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


def _crd_router_fields() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["router"]["properties"]


def _crd_bounds(schema: dict) -> Bounds:
    """The limits of a CRD number, OpenAPI v3.0's exclusive forms included."""
    low, high = schema.get("minimum"), schema.get("maximum")
    low_open, high_open = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    return Bounds(
        ge=None if low_open else low,
        gt=low if low_open else None,
        le=None if high_open else high,
        lt=high if high_open else None,
    )


def test_the_spec_router_options_are_those_the_crd_samples_name():
    assert {to_camel(opt.dest) for opt in SPEC_OPTIONS} == set(CRD_SAMPLES)


@pytest.mark.parametrize("opt", SPEC_OPTIONS, ids=lambda opt: opt.flag)
def test_the_crds_limits_are_the_options(opt):
    schema = _crd_router_fields()[to_camel(opt.dest)]
    assert schema["type"] == {int: "integer", float: "number"}[opt.type]
    assert _crd_bounds(schema) == opt.bounds
    for value in _just_outside(opt.bounds, step=1 if opt.type is int else 1e-6):
        with pytest.raises(pydantic.ValidationError):
            RouterSpec(**{opt.dest: opt.type(value)})


def _rendered_router_args(example: str, router: dict) -> list[str]:
    isvc = yaml.safe_load((ROOT / "examples" / example).read_text())
    isvc["spec"]["router"] = router
    (container,) = [
        container
        for o in render(parse_inference_service(isvc))
        if o["kind"] == "Deployment"
        for container in o["spec"]["template"]["spec"]["containers"]
        if container["args"][0] == "router"
    ]
    return container["args"][1:]


@pytest.mark.parametrize("opt", SPEC_OPTIONS, ids=lambda opt: opt.flag)
def test_every_router_option_of_the_crd_reaches_kubesgl_router(opt):
    value = CRD_SAMPLES[to_camel(opt.dest)]
    assert value != opt.default and opt.bounds.holds(value)
    args = _rendered_router_args("disaggregated.yaml", {to_camel(opt.dest): value})
    assert getattr(build_parser().parse_args(args), opt.dest) == value
    unset = build_parser().parse_args(_rendered_router_args("disaggregated.yaml", {}))
    assert getattr(unset, opt.dest) == opt.default


ROUTER_DOCS = ROOT / "docs" / "router.md"
# The table of one --help group's declared options, with its markers
_DOCS_TABLE = re.compile(
    r"<!-- router options: (?P<group>[^;]*);.*?-->\n.*?\n<!-- end of router options -->", flags=re.S
)
# A default the docs write in prose after its flag: "`--flag` (3 s)", "`--flag` seconds
# (default 5)". (That every flag they quote is the router's: tests/unit/test_docs_commands.py.)
_PROSE_DEFAULT = re.compile(r"`(--[a-z][a-z0-9-]*)`(?: [a-z]+)? \((?:default )?(\d[\d.]*)")


def _declared_options_by_group() -> dict[str, list[RouterOption]]:
    """The declared options of each --help group that has any, in --help's order."""
    by_dest = {opt.dest: opt for opt in OPTIONS}
    groups = {
        group.title or "": [by_dest[a.dest] for a in group._group_actions if a.dest in by_dest]
        for group in build_parser()._action_groups
    }
    return {title: options for title, options in groups.items() if options}


def _docs_default(value: float) -> str:
    return f"`{str(value).removesuffix('.0')}`"  # 5.0 as 5, as the prose writes it


def option_table(group: str, options: list[RouterOption]) -> str:
    """The markdown table of one --help group's options that docs/router.md must contain."""
    rows = [
        f"<!-- router options: {group}; generated from the settings' declarations "
        "(router/options.py); tests/unit/test_router_options.py prints it when it differs -->",
        "| option | default | meaning |",
        "| --- | --- | --- |",
    ]
    rows += [f"| `{opt.flag}` | {_docs_default(opt.default)} | {opt.help} |" for opt in options]
    return "\n".join(rows)


def test_the_docs_tables_list_every_router_option_with_its_default():
    docs = ROUTER_DOCS.read_text()
    found = {m["group"]: m.group(0) for m in _DOCS_TABLE.finditer(docs)}
    expected = _declared_options_by_group()
    assert {opt.flag for options in expected.values() for opt in options} == set(ROUTER_OPTIONS)
    assert set(found) == set(expected), "docs/router.md: one table of router options per group"
    for group, options in expected.items():
        table = option_table(group, options) + "\n<!-- end of router options -->"
        assert found[group] == table, "docs/router.md: replace the table with\n" + table


def test_every_default_the_docs_write_in_prose_is_the_flags():
    defaults = {flag: a.default for a in build_parser()._actions for flag in a.option_strings}
    for flag, written in _PROSE_DEFAULT.findall(ROUTER_DOCS.read_text()):
        assert float(written) == defaults[flag], (
            f"docs/router.md: {flag} defaults to {defaults[flag]}"
        )
