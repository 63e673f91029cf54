"""`kubesgl serve`'s command line: the engine options (engine/cli_args.py) and the server's
own, parsed and checked. Torch-free, so that the operator can check the command lines it
renders for engine pods with the very parser their engines use."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from kubesgl.cli_help import CommandParser, RefusingParser, port_or_zero
from kubesgl.contract import ENGINE_PORT, LOG_LEVELS, SHUTDOWN_TIMEOUT_S
from kubesgl.engine.cli_args import add_engine_args, engine_config_from_args
from kubesgl.engine.messages import HEARTBEAT_S
from kubesgl.engine.preflight import backend_device_problem
from kubesgl.engine.server.api_key import add_api_key_args


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # loopback, as SGLang: pods pass --host 0.0.0.0
    port: int = ENGINE_PORT
    api_key: str | None = field(default=None, repr=False)  # never logged
    served_model_name: str | None = None
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S
    # a ready engine whose scheduler sends nothing, not even its heartbeat, for this long is
    # hung (a step that never ends): the server exits, so that its pod restarts
    watchdog_timeout: float = 300.0
    log_level: str = "info"

    def validate(self) -> None:
        if self.served_model_name == "":  # "$NAME" unset: clients' name would never match
            raise ValueError(
                "--served-model-name is empty: give a name, or leave it out to serve the model "
                "under --model"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(
                f"--shutdown-timeout must be 0 or more seconds, not {self.shutdown_timeout:g}"
            )
        if self.watchdog_timeout < 3 * HEARTBEAT_S:  # slack for a late turn and the hops
            raise ValueError(
                f"--watchdog-timeout must be at least {3 * HEARTBEAT_S:g} s: an idle scheduler "
                f"says it is alive every {HEARTBEAT_S:g} s"
            )


def build_parser(parser_class: type[CommandParser] = CommandParser) -> CommandParser:
    parser = parser_class(prog="kubesgl serve", description="the OpenAI-compatible server")
    add_engine_args(parser)
    defaults = ServerOptions()
    server = parser.add_argument_group("server options")
    server.add_argument(
        "--host", default=defaults.host, help=f"address to listen on (default: {defaults.host})"
    )
    server.add_argument(
        "--port",
        type=port_or_zero,
        default=defaults.port,
        help=f"port of the HTTP API; 0: a free one, which the log names (default: {defaults.port})",
    )
    add_api_key_args(server)
    server.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name in the API (default: --model)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        default=defaults.shutdown_timeout,
        help=f"seconds requests in flight get to finish after SIGTERM (default: {defaults.shutdown_timeout})",
    )
    server.add_argument(
        "--watchdog-timeout",
        type=float,
        metavar="SECONDS",
        default=defaults.watchdog_timeout,
        help="exit when a ready engine's scheduler sends nothing for this long: a step hung "
        f"(default: {defaults.watchdog_timeout:g})",
    )
    server.add_argument(
        "--log-level",
        default=defaults.log_level,
        choices=LOG_LEVELS,
        help=f"(default: {defaults.log_level})",
    )
    return parser


def served_model_name(given: str | None, model: str) -> str:
    """The model's name to clients: --served-model-name where given, else --model as given (a
    Hugging Face id, not the snapshot folder it resolves to)."""
    return model if given is None else given


def server_options(args: argparse.Namespace, api_key: str | None = None) -> ServerOptions:
    return ServerOptions(
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_name=served_model_name(args.served_model_name, args.model),
        shutdown_timeout=args.shutdown_timeout,
        watchdog_timeout=args.watchdog_timeout,
        log_level=args.log_level,
    )


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """The arguments as `kubesgl serve` parses them (`--flag=value` resolved), not yet checked
    together; ValueError for an unknown flag or a bad value."""
    return build_parser(RefusingParser).parse_args(argv)


def check_serve_args(argv: list[str], environ: Mapping[str, str]) -> None:
    """Raises ValueError with the reason `kubesgl serve` would refuse these arguments, in a
    process with these environment variables, before it looks at the machine or the model: an
    unknown flag, a bad value, options that do not go together (an attention backend the
    --device cannot run)."""
    args = parse_serve_args(argv)
    engine_config_from_args(args).validate()
    server_options(args).validate()
    problem = backend_device_problem(args.attention_backend, args.device, environ)
    if problem is not None:
        raise ValueError(problem)
