"""Every engine option is declared once, as an EngineConfig field (engine/config.py). The
command lines of `kubesgl serve` and `kubesgl generate`, the CRD's `spec.engine` block, the
operator's render and the option table of docs/server.md must each agree with that
declaration: an option present in one of them but not in the others fails here."""

from __future__ import annotations

import argparse
import re
import types
import typing
from pathlib import Path

import pydantic
import pytest
import yaml
from pydantic.alias_generators import to_camel

from kubesgl import contract
from kubesgl.bounds import Bounds
from kubesgl.engine.cli_args import CLI_OPTIONS, engine_config_from_args, help_text
from kubesgl.engine.config import ENGINE_OPTIONS, EngineConfig, EngineOption
from kubesgl.engine.server.options import parse_serve_args
from kubesgl.operator.render import render
from kubesgl.operator.spec import EngineSpec
from kubesgl.operator.validation import parse_inference_service

ROOT = Path(__file__).resolve().parents[2]
SERVER_DOCS = ROOT / "docs" / "server.md"

# EngineConfig fields that an InferenceService does not set through spec.engine, and where
# their value comes from instead (the docs' table shows these words).
NOT_IN_CRD = {
    "model": "`spec.model` (the mounted weights)",
    "tp_size": "`tensorParallelSize` of the role",
    "role": "the role (`spec.mode`)",
    "seed": "",  # not a command-line option either: only the offline LLM API sets it
    "disaggregation_bootstrap_port": f"set by the operator ({contract.BOOTSTRAP_PORT})",
}
# spec.engine fields that are the pod's own settings (server flags, the pod spec), not EngineConfig's
POD_SETTINGS = {
    "api_key_secret",
    "compile_cache",
    "log_level",
    "shutdown_timeout_seconds",
    "extra_args",
}
# Flags of the commands that are not engine options
SERVE_ONLY_FLAGS = {
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--served-model-name",
    "--shutdown-timeout",
    "--watchdog-timeout",
    "--log-level",
}
GENERATE_ONLY_FLAGS = {"--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed"}
# A value other than the default for each engine option of spec.engine, to follow it into the pod
CRD_SAMPLES = {
    "device": "cpu",
    "dtype": "float16",
    "loadFormat": "dummy",
    "pageSize": 16,
    "maxRunningRequests": 8,
    "maxQueuedRequests": 64,
    "chunkedPrefillSize": 512,
    "maxTotalTokens": 4096,
    "attentionBackend": "flashinfer",
    "kvCacheDtype": "fp8_e4m3",
    "contextLength": 2048,
    "maxPrefillTokens": 1024,
    "memFractionStatic": 0.7,
    "defaultMaxTokens": 256,
    "cudaGraphMaxBs": 64,
    "piecewiseCudaGraphMaxTokens": 512,
    "disaggregationTimeout": 30.0,
    "maxSequencesPerRequest": 32,
    "maxStopStringLength": 64,
    "maxRequestBodyBytes": 1 << 20,
    "maxPromptCharsPerToken": 8,
    "schedulePolicy": "lpm",
    "scheduleMaxWait": 2.5,
    "disableRadixCache": True,
    "disableOverlapSchedule": True,
    "disableCudaGraph": True,
    "enableMixedChunk": True,
    "enablePiecewiseCudaGraph": True,
}
SPEC_OPTIONS = [name for name in EngineSpec.model_fields if name in ENGINE_OPTIONS]


def _parser(command: str) -> argparse.ArgumentParser:
    from kubesgl.engine.cli import build_parser as generate_parser
    from kubesgl.engine.server.options import build_parser as serve_parser

    return {"serve": serve_parser, "generate": generate_parser}[command]()


@pytest.mark.parametrize(
    ("command", "own_flags", "required"),
    [
        ("serve", SERVE_ONLY_FLAGS, ["--model", "m"]),
        ("generate", GENERATE_ONLY_FLAGS, ["--model", "m", "--prompt", "p"]),
    ],
)
def test_the_command_line_has_exactly_the_engine_options_and_its_own(command, own_flags, required):
    parser = _parser(command)
    flags = {flag for action in parser._actions for flag in action.option_strings} - {
        "-h",
        "--help",
    }
    assert flags - own_flags == {flag for opt in CLI_OPTIONS for flag in opt.flags}
    assert engine_config_from_args(parser.parse_args(required)) == EngineConfig(model="m")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_sglangs_model_path_flag_is_the_model(command):
    """SGLang's flag is --model-path, vLLM's --model: a command line written for either runs."""
    prompt = ["--prompt", "p"] if command == "generate" else []
    args = _parser(command).parse_args(["--model-path", "m", *prompt])
    assert engine_config_from_args(args) == EngineConfig(model="m")
    assert "--model MODEL, --model-path MODEL" in _parser(command).format_help()


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_every_flags_help_and_its_default_once(command):
    parser = _parser(command)
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        assert action.help.count("(default:") <= 1, action.help
    if command == "generate":  # the options generate refuses are left out of its help
        from kubesgl.engine.cli import REFUSED

        hidden = {a.dest for a in parser._actions if a.help == argparse.SUPPRESS}
        assert hidden == set(REFUSED)
    for opt in CLI_OPTIONS:
        shown = not (opt.required or opt.is_switch or opt.default is None)
        assert help_text(opt).count(f"(default: {opt.default})") == shown, opt.name
    text = parser.format_help()
    assert text.count("(default:") == sum("(default:" in action.help for action in parser._actions)


def test_every_engine_option_is_in_the_crd_or_deliberately_not():
    assert set(SPEC_OPTIONS).isdisjoint(NOT_IN_CRD)
    assert set(SPEC_OPTIONS) | set(NOT_IN_CRD) == set(ENGINE_OPTIONS), (
        "add it to EngineSpec or to NOT_IN_CRD"
    )
    assert set(EngineSpec.model_fields) == set(SPEC_OPTIONS) | POD_SETTINGS, (
        "spec.engine field of no option"
    )
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    crd_fields = set(spec["properties"]["engine"]["properties"])
    assert crd_fields == {to_camel(name) for name in EngineSpec.model_fields}


def _just_outside(bounds: Bounds, step: float) -> list[float]:
    """For each limit, the value nearest to it that it excludes."""
    values = []
    if bounds.ge is not None:
        values.append(bounds.ge - step)
    if bounds.gt is not None:
        values.append(bounds.gt)
    if bounds.le is not None:
        values.append(bounds.le + step)
    if bounds.lt is not None:
        values.append(bounds.lt)
    return values


# spec.engine fields that take fewer values than their flag, each with why (the docs' table
# names the CRD's values); every other field takes every value of its flag.
CRD_NARROWER = {"device": "no `auto`: the operator must know whether the pods request GPUs"}


def _value_type(name: str) -> object:
    """The type of a spec.engine field, None (unset) left out."""
    value_type = EngineSpec.model_fields[name].annotation
    if typing.get_origin(value_type) in (typing.Union, types.UnionType):
        (value_type,) = [t for t in typing.get_args(value_type) if t is not type(None)]
    return value_type


def _crd_choices(name: str) -> tuple:
    value_type = _value_type(name)
    return typing.get_args(value_type) if typing.get_origin(value_type) is typing.Literal else ()


def _spec_bounds(name: str) -> Bounds:
    """The limits of a spec.engine field, as pydantic keeps them."""
    limits = {
        key: getattr(constraint, key)
        for constraint in EngineSpec.model_fields[name].metadata
        for key in ("ge", "gt", "le", "lt")
        if hasattr(constraint, key)
    }
    return Bounds(**limits)


@pytest.mark.parametrize("name", SPEC_OPTIONS)
def test_a_numeric_crd_field_has_the_engines_bounds(name):
    """One declaration: a number the flag takes, the field takes too (chunkedPrefillSize -1,
    no chunking, as --chunked-prefill-size -1)."""
    assert _spec_bounds(name) == ENGINE_OPTIONS[name].bounds


@pytest.mark.parametrize("name", SPEC_OPTIONS)
def test_the_crd_field_takes_only_what_the_engine_takes(name):
    opt, field = ENGINE_OPTIONS[name], EngineSpec.model_fields[name]
    choices = _crd_choices(name)
    if choices:
        assert set(choices) <= set(opt.choices), f"{name}: choices the engine lacks"
        assert choices == tuple(c for c in opt.choices if c in choices)
    else:
        assert _value_type(name) is opt.type and not opt.choices, name
    if field.default is not None:
        assert opt.problem(field.default) is None, name
    for value in _just_outside(opt.bounds, step=1 if opt.type is int else 1e-6):
        assert opt.problem(opt.type(value)) is not None
        with pytest.raises(pydantic.ValidationError):
            EngineSpec(**{name: opt.type(value)})


@pytest.mark.parametrize("name", [name for name in SPEC_OPTIONS if ENGINE_OPTIONS[name].choices])
def test_every_value_of_a_flag_is_a_value_of_its_crd_field(name):
    """`attentionBackend: auto` was refused, while docs/server.md's table listed `auto` among
    the values of the flag that attentionBackend sets."""
    missing = set(ENGINE_OPTIONS[name].choices) - set(_crd_choices(name))
    assert not missing or name in CRD_NARROWER, f"{name}: the CRD lacks {sorted(missing)}"
    for value in _crd_choices(name):
        assert getattr(_serve_args({to_camel(name): value}), name) == value


def _serve_args(engine: dict) -> argparse.Namespace:
    from kubesgl.engine.server.options import build_parser

    isvc = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    isvc["spec"]["engine"] = engine
    (deployment,) = [
        o
        for o in render(parse_inference_service(isvc))
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-mixed")
    ]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return build_parser().parse_args(args[1:])


def test_every_engine_option_of_the_crd_reaches_kubesgl_serve():
    assert set(CRD_SAMPLES) == {to_camel(name) for name in SPEC_OPTIONS}, "give CRD_SAMPLES a value"
    for name in SPEC_OPTIONS:
        value = CRD_SAMPLES[to_camel(name)]
        assert (
            value != ENGINE_OPTIONS[name].default and value != EngineSpec.model_fields[name].default
        )
        assert getattr(_serve_args({to_camel(name): value}), name) == value, name
    parsed = _serve_args({})
    for (
        name
    ) in SPEC_OPTIONS:  # unset: the engine's own default (device and dtype have CRD defaults)
        default = EngineSpec.model_fields[name].default
        expected = ENGINE_OPTIONS[name].default if default is None else default
        assert getattr(parsed, name) == expected, name


def _values(opt: EngineOption) -> str:
    if opt.choices:
        return ", ".join(f"`{choice}`" for choice in opt.choices)
    kind = {int: "integer", float: "number", bool: "switch", str: "text"}[opt.type]
    limits = opt.bounds.describe() if opt.bounds != Bounds() else ""
    return f"{kind}, {limits}" if limits else kind


def _default(opt: EngineOption) -> str:
    if opt.required:
        return "required"
    if opt.is_switch:
        return "off"
    return "unset" if opt.default is None else f"`{opt.default}`"


def option_table() -> str:
    """The markdown table of engine options that docs/server.md must contain."""
    rows = [
        "| option | values | default | `spec.engine` | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for opt in CLI_OPTIONS:
        flags = ", ".join(f"`{flag}`" for flag in opt.flags)
        rows.append(
            f"| {flags} | {_values(opt)} | {_default(opt)} | {_crd_column(opt)} | {opt.help} |"
        )
    return "\n".join(rows)


def _crd_column(opt: EngineOption) -> str:
    """The spec.engine field that sets the option, with its own values and default where they
    are not the flag's."""
    if opt.name not in SPEC_OPTIONS:
        return NOT_IN_CRD[opt.name]
    notes = []
    if opt.name in CRD_NARROWER:
        notes.append(", ".join(f"`{choice}`" for choice in _crd_choices(opt.name)))
    default = EngineSpec.model_fields[opt.name].default
    if default is not None and default != opt.default:
        notes.append(f"default `{default}`")
    if opt.name in CRD_NARROWER:
        notes.append(CRD_NARROWER[opt.name])
    field = f"`{to_camel(opt.name)}`"
    return f"{field} ({'; '.join(notes)})" if notes else field


def test_the_docs_table_lists_every_engine_option():
    docs = SERVER_DOCS.read_text()
    found = re.search(
        r"<!-- engine options.*?-->\n(.*?)\n<!-- end of engine options -->", docs, flags=re.S
    )
    assert found, "docs/server.md lost its engine option table"
    assert found.group(1) == option_table(), (
        "docs/server.md: replace the table with\n" + option_table()
    )
    for flag in SERVE_ONLY_FLAGS:
        assert f"`{flag}`" in docs, f"docs/server.md does not document {flag}"


@pytest.mark.parametrize("value", [0, -1])
def test_a_cuda_graph_batch_size_below_one_is_refused_not_graphs_off(value):
    """It turned CUDA graphs off without a word (--disable-cuda-graph says that); the CRD
    refuses it too."""
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be at least 1"):
        EngineConfig(model="m", cuda_graph_max_bs=value).validate()


# SGLang's flags (sglang.launch_server) that kubesgl serve takes under the same name, each with
# a value: a command line written for SGLang keeps running, `--flag=value` form included
SGLANG_FLAGS = {
    "--model-path": "m",
    "--tp-size": "1",
    "--tp": "1",  # its docs' spelling, a prefix its own parser takes
    "--tensor-parallel-size": "1",  # its full name, and vLLM's
    "--context-length": "512",
    "--mem-fraction-static": "0.5",
    "--max-running-requests": "8",
    "--max-total-tokens": "4096",
    "--max-prefill-tokens": "1024",
    "--chunked-prefill-size": "512",
    "--page-size": "16",
    "--kv-cache-dtype": "auto",
    "--attention-backend": "torch",
    "--schedule-policy": "lpm",
    "--cuda-graph-max-bs": "8",
    "--served-model-name": "n",
}


@pytest.mark.parametrize(("flag", "value"), SGLANG_FLAGS.items())
def test_sglangs_flags_stay_accepted(flag, value):
    args = ["--model", "m"] if flag != "--model-path" else []
    parser = _parser("serve")
    assert parser.parse_args([*args, flag, value]) == parser.parse_args([*args, f"{flag}={value}"])


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize(
    ("given", "ours"),
    [
        (["--max-model-len", "512"], "--context-length"),
        (["-tp", "1"], "--tp-size"),
        (["--gpu-memory-utilization=0.5"], "--mem-fraction-static"),
        (["--max-num-seqs", "8"], "--max-running-requests"),
        (["--block-size", "16"], "--page-size"),
        (["--enforce-eager"], "--disable-cuda-graph"),
    ],
)
def test_another_servers_flag_is_refused_with_the_flag_to_use(command, given, ours, capsys):
    """vLLM's flags were refused as `unrecognized arguments` and nothing more."""
    prompt = ["--prompt", "p"] if command == "generate" else []
    with pytest.raises(SystemExit) as exit_:
        _parser(command).parse_args(["--model", "m", *prompt, *given])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert err == (
        f"kubesgl {command}: error: unrecognized arguments: {' '.join(given)}; "
        f"{given[0].split('=')[0]} is {ours} in kubesgl {command}"
    )


def test_every_flag_named_elsewhere_points_to_an_option_kubesgl_serve_takes():
    parser = _parser("serve")
    for opt in CLI_OPTIONS:
        for flag in opt.named_elsewhere:
            assert flag not in parser._option_string_actions, flag  # refused, not taken
            with pytest.raises(ValueError, match=f"; {flag} is {opt.flag} in kubesgl serve$"):
                parse_serve_args(["--model", "m", flag, "1"])


@pytest.mark.parametrize("prefix", ["--tp-s", "--context", "--mem-fraction", "--mod"])
def test_a_prefix_of_a_flag_is_not_the_flag(prefix):
    """argparse took any prefix that names one flag alone, so that a new flag could change
    what a command line that ran meant."""
    with pytest.raises(ValueError, match=f"unrecognized arguments: {prefix} 1$"):
        parse_serve_args(["--model", "m", prefix, "1"])
