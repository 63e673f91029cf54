"""What the benchmark scripts share: the engine's own options and what a result records of
the engine, a free port for the servers they start, a `kubesgl bench serving` run against
them, and printing and saving a result as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch

from kubesgl.cli_help import CommandParser
from kubesgl.engine import LLM
from kubesgl.engine.cli_args import add_engine_args, engine_config_from_args


def engine_parser(doc: str | None, **defaults) -> CommandParser:
    """The argument parser of a benchmark that builds an engine: its docstring as the help, and
    every option of `kubesgl serve`'s engine with this benchmark's own defaults."""
    parser = CommandParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.set_defaults(**defaults)
    return parser


def engine_facts(args: argparse.Namespace, llm: LLM) -> dict:
    """What a result records of the engine it measured."""
    device = llm.engine.device
    return {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": str(llm.engine.dtype),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "attention_backend": args.attention_backend,
    }


def make_llm(args: argparse.Namespace, **workload) -> LLM:
    """The engine `args` describe; `workload` sets what the benchmark's workload dictates
    (its context length, how many requests run at once), whatever the command line said."""
    config = dataclasses.replace(engine_config_from_args(args), **workload)
    options = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    return LLM(options.pop("model"), **options)


def free_port() -> int:
    """A TCP port free on loopback now, for a server the benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_serving(
    base_url: str, *options: str, check: bool = True, env: dict[str, str] | None = None
) -> dict:
    """The JSON result of `kubesgl bench serving --base-url BASE_URL OPTIONS` (its printout
    silenced). `check`: a failed run raises; without it, its result holds the failures."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "serving.json")
        command = ["bench", "serving", "--base-url", base_url, *options, "--output-file", out]
        subprocess.run(
            [sys.executable, "-m", "kubesgl", *command],
            check=check,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        with open(out) as f:
            return json.load(f)


def report(result: dict, out: str | None) -> None:
    """Print `result` as JSON and, when `out` is given, write it there too."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
