"""`kubesgl serve`: the OpenAI-compatible server."""

from __future__ import annotations

import logging
import os
import sys

from kubesgl.contract import API_KEY_ENV
from kubesgl.engine.cli_args import engine_config_from_args
from kubesgl.engine.preflight import StartupError, check_bootstrap_port, check_engine
from kubesgl.engine.server.api_key import resolve_api_key
from kubesgl.engine.server.options import build_parser, server_options
from kubesgl.listen import CannotListen, listen_socket


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    config = engine_config_from_args(args)
    try:
        config.validate()
        options = server_options(args, resolve_api_key(args))
        options.validate()
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.pop(API_KEY_ENV, None)  # the server's child processes need no key
    try:  # what can be found before a child starts: one line and status 2, as kubesgl generate
        config = check_engine(config)  # a Hugging Face id becomes its snapshot's folder
        check_bootstrap_port(config, args.host)
        sock = listen_socket(args.host, args.port)
    except (StartupError, CannotListen) as exc:
        print(f"kubesgl serve: {exc}", file=sys.stderr)
        return 2
    # torch, transformers and the HTTP stack take seconds to import: not before the arguments
    # are parsed and checked, so that --help and a usage error are answered at once
    from kubesgl.engine.server.launcher import Server

    server = Server(config, options, sock)
    status = server.run()
    if server.failure:  # the last line of the log names the problem (kubesgl up shows it)
        print(f"kubesgl serve: {server.failure}", file=sys.stderr)
    return status
