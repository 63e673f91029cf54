"""`kubesgl operator`: run the kopf operator against the cluster of the current credentials."""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

from kubesgl.cli_help import CommandParser, DefaultsOnce, port_or_zero
from kubesgl.contract import LOG_LEVELS
from kubesgl.operator.handlers import OperatorState, registry
from kubesgl.operator.kube import NoCluster, check_reachable, load_credentials


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = CommandParser(
        prog="kubesgl operator",
        description="Reconcile InferenceService objects into engine, router and autoscaler"
        " objects.",
        formatter_class=DefaultsOnce,
    )
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; kopf glob patterns allowed);"
        " default: all namespaces",
    )
    parser.add_argument(
        "--liveness-port",
        # checked here: kopf would fail to bind 70000 or -1 only once connected to the cluster
        type=port_or_zero,
        default=8080,
        metavar="PORT",
        help="port of the /healthz endpoint for the pod's liveness probe (0 disables it)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log level",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # kopf would log each failed attempt with a traceback and retry forever: say it once instead
    try:
        load_credentials()
        check_reachable()
    except NoCluster as error:
        print(f"kubesgl operator: no Kubernetes cluster reachable: {error}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    # standalone: one operator replica (the chart runs one, with the Recreate strategy), so no
    # peering objects are needed to keep two from acting at once.
    kopf.run(
        registry=registry,
        memo=OperatorState(),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0
