"""`kubesgl serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kubesgl.contract import API_KEY_ENV
from kubesgl.engine.cli_args import add_engine_args, engine_config_from_args
from kubesgl.engine.preflight import StartupError, check_bootstrap_port, check_engine, listen_socket
from kubesgl.engine.scheduler.process import HEARTBEAT_S
from kubesgl.engine.server.api_key import add_api_key_args, resolve_api_key
from kubesgl.engine.server.launcher import Server, ServerOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubesgl serve", description=__doc__)
    add_engine_args(parser)
    defaults = ServerOptions()
    server = parser.add_argument_group("server options")
    server.add_argument(
        "--host", default=defaults.host, help=f"address to listen on (default: {defaults.host})"
    )
    server.add_argument(
        "--port",
        type=int,
        default=defaults.port,
        help=f"port of the HTTP API (default: {defaults.port})",
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
        choices=["debug", "info", "warning", "error"],
        help=f"(default: {defaults.log_level})",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    config = engine_config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    if args.watchdog_timeout < 2 * HEARTBEAT_S:
        parser.error(
            f"--watchdog-timeout must be at least {2 * HEARTBEAT_S:g} s: an idle scheduler "
            f"says it is alive every {HEARTBEAT_S:g} s"
        )
    try:
        api_key = resolve_api_key(args)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.pop(API_KEY_ENV, None)  # the server's child processes need no key
    try:  # what can be found before a child starts: one line and status 2, as kubesgl generate
        config = check_engine(config)  # a Hugging Face id becomes its snapshot's folder
        check_bootstrap_port(config, args.host)
        sock = listen_socket(args.host, args.port)
    except StartupError as exc:
        print(f"kubesgl serve: {exc}", file=sys.stderr)
        return 2
    options = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_name=args.served_model_name or args.model,
        shutdown_timeout=args.shutdown_timeout,
        watchdog_timeout=args.watchdog_timeout,
        log_level=args.log_level,
    )
    server = Server(config, options, sock)
    status = server.run()
    if server.failure:  # the last line of the log names the problem (kubesgl up shows it)
        print(f"kubesgl serve: {server.failure}", file=sys.stderr)
    return status
