"""`kubesgl generate`: offline generation from the command line (no server)."""

from __future__ import annotations

import dataclasses
import sys

from kubesgl.cli_help import CommandParser
from kubesgl.engine.child_process import start_failure_line
from kubesgl.engine.cli_args import add_engine_args, engine_config_from_args
from kubesgl.engine.config import OFFLINE_REFUSED
from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams

# Engine options kubesgl generate cannot honour, and why: a value other than the default is
# refused (an option is never ignored); `kubesgl generate --help` leaves them out.
REFUSED = {
    **OFFLINE_REFUSED,
    "default_max_tokens": "kubesgl generate gives every prompt --max-tokens",
}


def build_parser() -> CommandParser:
    parser = CommandParser(prog="kubesgl generate", description=__doc__)
    add_engine_args(parser, refused=REFUSED)
    sampling = parser.add_argument_group("generation")
    sampling.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat for a batch)"
    )
    sampling.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens generated per prompt (default: 64)",
    )
    sampling.add_argument(
        "--temperature", type=float, default=0.0, metavar="X", help="0 is greedy (default: 0.0)"
    )
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="X", help="(default: 1.0)")
    sampling.add_argument(
        "--top-k", type=int, default=-1, metavar="N", help="-1: no limit (default: -1)"
    )
    sampling.add_argument(
        "--seed", type=int, default=None, metavar="N", help="sampling seed (default: unseeded)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    options = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    # torch and transformers take seconds to import: not before the arguments are parsed, so
    # that --help and a usage error are answered at once
    from kubesgl.engine.llm import LLM

    try:
        llm = LLM(config.model, **options)
    except (
        ValueError,
        OSError,
    ) as exc:  # options this machine or model cannot run, a missing model
        print(f"kubesgl generate: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a checkpoint that does not load (a broken shard, say)
        print(
            f"kubesgl generate: the engine could not start: {start_failure_line(exc)}",
            file=sys.stderr,
        )
        return 1
    with llm:
        try:
            outputs = llm.generate(args.prompt, params)
        except InvalidRequestError as exc:
            print(f"kubesgl generate: {exc}", file=sys.stderr)
            return 2
        for prompt, out in zip(args.prompt, outputs):
            print(
                f"{prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]"
            )
    return 0
