"""`kubesgl router`: parse the command line, build the router and serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping

from kubesgl import contract
from kubesgl.cli_help import DefaultsOnce, RefusingParser, port_number
from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV, LOG_LEVELS
from kubesgl.router.config import KubeDiscoverySettings, RouterConfig, parse_prefill_spec
from kubesgl.router.discovery import parse_selector
from kubesgl.router.health import HealthSettings
from kubesgl.router.policies import POLICY_NAMES, CacheAwareSettings
from kubesgl.router.routing import DisaggregationSettings, RetrySettings
from kubesgl.router.security import check_key

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# On SIGTERM, streams still running get this long to finish (Kubernetes' default grace is 30 s).
GRACEFUL_SHUTDOWN_S = 25


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    p = parser_class(
        prog="kubesgl router",
        description="Cache-aware router and prefill/decode orchestrator in front of kubesgl engines.",
        epilog=f"Keys come from the environment: {ADMIN_KEY_ENV} opens POST/DELETE /workers (without it they "
        f"answer 403); {API_KEY_ENV}, the engines' API key, is what clients must send and what the router "
        "sends engines in place of the client's credentials.",
        formatter_class=DefaultsOnce,
    )
    w = p.add_argument_group("workers (fixed URLs, or Kubernetes discovery, or both)")
    w.add_argument(
        "--worker",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="a mixed-role engine",
    )
    w.add_argument(
        "--prefill",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL[@BOOTSTRAP_PORT]",
        help=f"a prefill engine and its bootstrap port (default {contract.BOOTSTRAP_PORT})",
    )
    w.add_argument(
        "--decode", action="extend", nargs="+", default=[], metavar="URL", help="a decode engine"
    )
    w.add_argument(
        "--kube-namespace",
        default=None,
        metavar="NS",
        help="namespace of the engine pods (default: the router pod's own, else `default`); "
        "given alone, it turns Kubernetes discovery on for every engine pod there",
    )
    w.add_argument(
        "--kube-selector",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="label selector of engine pods, all of which must match (equality only; several, "
        "or comma-separated as kubectl takes them: a=b,c=d); turns Kubernetes discovery on",
    )
    w.add_argument(
        "--kube-worker-port",
        type=port_number,
        default=contract.ENGINE_PORT,
        metavar="PORT",
        help="engine port in pods that name no container port `http`",
    )

    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface, as in a pod)",
    )
    s.add_argument(
        "--port",
        type=port_number,
        default=contract.ROUTER_PORT,
        help="port of the OpenAI-compatible API",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log level",
    )
    s.add_argument(
        "--admin-api-key",
        default=None,
        metavar="KEY",
        help=f"the admin key, as SGLang's router takes it; prefer ${ADMIN_KEY_ENV} (a key on the "
        "command line shows in `ps`). Without a key, POST/DELETE /workers answer 403",
    )

    defaults = RouterConfig()
    r = p.add_argument_group("routing")
    cache = defaults.cache_aware
    r.add_argument(
        "--policy",
        default=defaults.policy,
        choices=POLICY_NAMES,
        help="how a worker is picked for a request (docs/router.md, Routing policies)",
    )
    r.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES, help="default: --policy")
    r.add_argument("--decode-policy", default=None, choices=POLICY_NAMES, help="default: --policy")
    r.add_argument(
        "--cache-threshold",
        type=float,
        default=cache.cache_threshold,
        metavar="X",
        help="cache_aware: least matched share of a request to follow its cache",
    )
    r.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=cache.balance_abs_threshold,
        metavar="N",
        help="cache_aware: in-flight gap (max - min) beyond which loads are balanced",
    )
    r.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=cache.balance_rel_threshold,
        metavar="X",
        help="cache_aware: in-flight ratio (max / min) beyond which loads are balanced",
    )
    r.add_argument(
        "--max-tree-chars",
        type=int,
        default=cache.max_tree_chars,
        metavar="N",
        help="cache_aware: characters remembered per worker (LRU eviction beyond)",
    )

    d = p.add_argument_group("prefill/decode: when a decode worker prefills a request itself")
    pd = defaults.disaggregation
    d.add_argument(
        "--pd-min-prefill-tokens",
        type=int,
        default=pd.min_prefill_tokens,
        metavar="N",
        help="requests whose uncached prompt is shorter (estimated at 4 characters a token for "
        "text) go to a decode worker alone; 0: always disaggregate",
    )
    d.add_argument(
        "--pd-max-prefill-in-flight",
        type=int,
        default=pd.max_prefill_in_flight,
        metavar="N",
        help="when every prefill worker has this many requests in flight, new ones go to a "
        "decode worker alone",
    )

    h = p.add_argument_group("health, circuit breaker, retries, timeouts")
    health, retry = defaults.health, defaults.retry
    h.add_argument(
        "--health-check-interval",
        type=float,
        default=health.interval_s,
        metavar="S",
        help="seconds between two health checks of a worker",
    )
    h.add_argument(
        "--health-check-timeout",
        type=float,
        default=health.timeout_s,
        metavar="S",
        help="seconds a health check may take before it counts as failed",
    )
    h.add_argument(
        "--health-failure-threshold",
        type=int,
        default=health.failure_threshold,
        metavar="N",
        help="consecutive failed checks before a worker leaves the pool",
    )
    h.add_argument(
        "--health-success-threshold",
        type=int,
        default=health.success_threshold,
        metavar="N",
        help="consecutive passed checks before it comes back",
    )
    h.add_argument(
        "--breaker-failure-threshold",
        type=int,
        default=defaults.breaker_failure_threshold,
        metavar="N",
        help="consecutive failed requests that open a worker's circuit",
    )
    h.add_argument(
        "--breaker-cooldown",
        type=float,
        default=defaults.breaker_cooldown_s,
        metavar="S",
        help="seconds an open circuit keeps a worker out",
    )
    h.add_argument(
        "--max-retries",
        type=int,
        default=retry.max_retries,
        metavar="N",
        help="times a request a worker failed before answering is sent again, to another worker "
        "where there is one",
    )
    h.add_argument(
        "--retry-initial-backoff",
        type=float,
        default=retry.initial_backoff_s,
        metavar="S",
        help="seconds before the first retry; each next one waits twice as long",
    )
    h.add_argument(
        "--retry-max-backoff",
        type=float,
        default=retry.max_backoff_s,
        metavar="S",
        help="longest wait before a retry",
    )
    h.add_argument(
        "--connect-timeout",
        type=float,
        default=defaults.connect_timeout_s,
        metavar="S",
        help="seconds to open a connection to a worker",
    )
    h.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        metavar="S",
        help="longest wait for the next byte of a worker's answer",
    )
    h.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="open connections to all workers together",
    )
    return p


def _default_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _keys(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(admin key, engines' key) from the environment, or the admin key from its flag. A
    variable that is set must hold a key: an empty one is an error, as in the engine."""
    admin = environ.get(ADMIN_KEY_ENV)
    if admin is not None and args.admin_api_key is not None:
        raise ValueError(
            f"the admin key is given twice: set {ADMIN_KEY_ENV} or pass --admin-api-key, not both"
        )
    if admin is None and args.admin_api_key is not None:
        admin = check_key("--admin-api-key", args.admin_api_key)
    return admin, environ.get(API_KEY_ENV)  # RouterConfig checks them


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    admin_api_key, api_key = _keys(args, os.environ if environ is None else environ)
    kube = None
    if args.kube_selector or args.kube_namespace:
        kube = KubeDiscoverySettings(
            namespace=args.kube_namespace or _default_namespace(),
            selector=parse_selector(args.kube_selector),
            worker_port=args.kube_worker_port,
        )
    config = RouterConfig(
        workers=args.worker,
        prefill=[parse_prefill_spec(spec) for spec in args.prefill],
        decode=args.decode,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        cache_aware=CacheAwareSettings(
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            max_tree_chars=args.max_tree_chars,
        ),
        health=HealthSettings(
            interval_s=args.health_check_interval,
            timeout_s=args.health_check_timeout,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
        ),
        retry=RetrySettings(
            max_retries=args.max_retries,
            initial_backoff_s=args.retry_initial_backoff,
            max_backoff_s=args.retry_max_backoff,
        ),
        disaggregation=DisaggregationSettings(
            min_prefill_tokens=args.pd_min_prefill_tokens,
            max_prefill_in_flight=args.pd_max_prefill_in_flight,
        ),
        breaker_failure_threshold=args.breaker_failure_threshold,
        breaker_cooldown_s=args.breaker_cooldown,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        max_connections=args.max_connections,
        admin_api_key=admin_api_key,
        api_key=api_key,
        kube=kube,
    )
    if not (config.workers or config.prefill or config.kube or config.admin_api_key):
        # without the admin key POST /workers is off: such a router would answer 503 forever
        raise ValueError(
            "no workers, and no way to add one: give --worker, --prefill and --decode, or"
            f" --kube-selector; or set {ADMIN_KEY_ENV} to add them with POST /workers"
        )
    return config


def parse_router_args(argv: list[str]) -> argparse.Namespace:
    """The arguments as `kubesgl router` parses them (abbreviations and `--flag=value`
    resolved); ValueError for an unknown flag or a bad value."""
    return build_parser(RefusingParser).parse_args(argv)


def check_router_args(argv: list[str], environ: Mapping[str, str]) -> None:
    """Raises ValueError with the reason `kubesgl router` would refuse these arguments at
    start, in a process with these environment variables. Torch-free: the operator checks the
    command lines it renders for router pods with it."""
    config_from_args(parse_router_args(argv), environ)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.admin_api_key is not None:
        print(
            f"kubesgl router: --admin-api-key shows the admin key to anyone who can list processes; "
            f"set {ADMIN_KEY_ENV} instead",
            file=sys.stderr,
        )
    for note in config.ignored_options():
        print(f"kubesgl router: {note}", file=sys.stderr)
    if not (config.workers or config.prefill or config.kube):  # the admin key is set
        print("kubesgl router: no workers yet; add them with POST /workers", file=sys.stderr)

    import uvicorn  # imported late: `--help` stays fast

    from kubesgl.gc_pacing import GcPacer
    from kubesgl.router.app import RouterApp

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        RouterApp(config, GcPacer(), signal.Signals[contract.ROUTER_CHECK_SIGNAL]),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,  # one log line per request costs more than the routing itself
        proxy_headers=False,  # the router never uses the client's address: skip the middleware
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=contract.SERVER_KEEP_ALIVE_S,
    )
    return 0
