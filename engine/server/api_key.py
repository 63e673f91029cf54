"""The API key of `kubesgl serve`. `--api-key KEY` is SGLang's flag, but a command line is
visible to every user of the machine (`ps`, /proc/PID/cmdline); `--api-key-file PATH` and the
environment variable KUBESGL_API_KEY (what the operator's pods set from a Secret) are not.
The key is never logged and never shown by an endpoint."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from kubesgl.contract import API_KEY_ENV, bearer_key_problem


def add_api_key_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
        "/version (docs/security.md); other users of this "
        f"machine can read a command line: prefer --api-key-file or ${API_KEY_ENV} "
        f"(default: ${API_KEY_ENV} where set, else no key)",
    )
    group.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (surrounding whitespace removed)",
    )


def resolve_api_key(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The key the server requires, or None: --api-key, else --api-key-file, else the
    environment. Raises ValueError for both flags, an unreadable file, or an empty key (a
    Secret without its value must not open the server)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        source = f"--api-key-file {args.api_key_file}"
    elif API_KEY_ENV in environ:
        key, source = environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    if not key:
        raise ValueError(
            f"the API key of {source} is empty (unset {API_KEY_ENV} to serve without a key)"
            if source == f"${API_KEY_ENV}"
            else f"the API key of {source} is empty"
        )
    # required as it is, such a key answered every request 401 (the router refuses it too)
    problem = bearer_key_problem(key)
    if problem is not None:
        raise ValueError(f"the API key of {source} {problem}")
    return key
