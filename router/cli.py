"""`kubesgl router`: parse the command line, build the router and serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

from kubesgl import contract
from kubesgl.cli_help import CommandParser, DefaultsOnce, RefusingParser, at_least, port_number
from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV, LOG_LEVELS
from kubesgl.listen import CannotListen, listen_socket
from kubesgl.router.config import KubeDiscoverySettings, RouterConfig, parse_prefill_spec
from kubesgl.router.discovery import parse_selector
from kubesgl.router.health import HealthSettings
from kubesgl.router.options import add_options, options_of, values_from_args
from kubesgl.router.policies import POLICY_NAMES, CacheAwareSettings
from kubesgl.router.routing import DisaggregationSettings, RetrySettings
from kubesgl.router.security import check_key

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_HOST = "127.0.0.1"
_BREAKER_OPTIONS = {"breaker_failure_threshold", "breaker_cooldown_s"}
# The flags of --help's group "health, circuit breaker, retries, timeouts", in its order
_RESILIENCE_OPTIONS = (
    *options_of(HealthSettings),
    *(opt for opt in options_of(RouterConfig) if opt.name in _BREAKER_OPTIONS),
    *options_of(RetrySettings),
    *(opt for opt in options_of(RouterConfig) if opt.name not in _BREAKER_OPTIONS),
)


def build_parser(
    parser_class: type[CommandParser] = CommandParser,
) -> CommandParser:
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
    # None where not given: --fd takes neither (its socket has its address already)
    s.add_argument(
        "--host",
        default=None,
        help=f"address to listen on (default: {DEFAULT_HOST}; 0.0.0.0: every interface, as in "
        "a pod)",
    )
    s.add_argument(
        "--port",
        type=port_number,
        default=None,
        help=f"port of the OpenAI-compatible API (default: {contract.ROUTER_PORT})",
    )
    s.add_argument(
        "--fd",
        type=at_least(0),
        default=None,
        help="serve on this listening socket, inherited open, instead of binding --host and "
        "--port, which it takes neither of (kubesgl up holds the router's port from its own "
        "start and passes it)",
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

    r = p.add_argument_group("routing")
    r.add_argument(
        "--policy",
        default=RouterConfig().policy,
        choices=POLICY_NAMES,
        help="how a worker is picked for a request (docs/router.md, Routing policies)",
    )
    r.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES, help="default: --policy")
    r.add_argument("--decode-policy", default=None, choices=POLICY_NAMES, help="default: --policy")
    add_options(r, options_of(CacheAwareSettings))
    d = p.add_argument_group("prefill/decode: when a decode worker prefills a request itself")
    add_options(d, options_of(DisaggregationSettings))
    h = p.add_argument_group("health, circuit breaker, retries, timeouts")
    add_options(h, _RESILIENCE_OPTIONS)
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
    if args.fd is not None and (args.host is not None or args.port is not None):
        # the socket's address is its own: either flag would be ignored
        raise ValueError(
            f"--fd {args.fd} serves a socket that listens already: give --host and --port, or "
            "--fd, not both"
        )
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
        cache_aware=CacheAwareSettings(**values_from_args(CacheAwareSettings, args)),
        health=HealthSettings(**values_from_args(HealthSettings, args)),
        retry=RetrySettings(**values_from_args(RetrySettings, args)),
        disaggregation=DisaggregationSettings(**values_from_args(DisaggregationSettings, args)),
        **values_from_args(RouterConfig, args),
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
    """The arguments as `kubesgl router` parses them (`--flag=value` resolved); ValueError for
    an unknown flag or a bad value."""
    return build_parser(RefusingParser).parse_args(argv)


def check_router_args(argv: list[str], environ: Mapping[str, str]) -> None:
    """Raises ValueError with the reason `kubesgl router` would refuse these arguments at
    start, in a process with these environment variables. Torch-free: the operator checks the
    command lines it renders for router pods with it."""
    config_from_args(parse_router_args(argv), environ)


def _listener(args: argparse.Namespace) -> socket.socket:
    """The socket of --fd, listening already, else one listening on --host and --port now."""
    if args.fd is None:
        return listen_socket(
            DEFAULT_HOST if args.host is None else args.host,
            contract.ROUTER_PORT if args.port is None else args.port,
        )
    try:
        sock = socket.socket(fileno=args.fd)
    except OSError as exc:
        raise CannotListen(f"--fd {args.fd}: not an open socket ({exc.strerror})") from None
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        # uvicorn would fail on its first accept(), after the app's startup
        sock.close()
        raise CannotListen(f"--fd {args.fd}: a socket that does not listen (bound, connected?)")
    return sock


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

    # a port in use: one line and status 2 before anything starts, as `kubesgl serve` says it
    # (uvicorn's own bind fails after the app's startup, with status 3)
    try:
        sock = _listener(args)
    except CannotListen as exc:
        print(f"kubesgl router: {exc}", file=sys.stderr)
        return 2

    import uvicorn  # imported late: `--help` stays fast

    from kubesgl.gc_pacing import GcPacer
    from kubesgl.router.app import RouterApp

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server_config = uvicorn.Config(
        RouterApp(config, GcPacer(), signal.Signals[contract.ROUTER_CHECK_SIGNAL]),
        log_level=args.log_level,
        access_log=False,  # one log line per request costs more than the routing itself
        proxy_headers=False,  # the router never uses the client's address: skip the middleware
        server_header=False,
        # streams still running at SIGTERM get this long (RouterApp ends those it cuts); the
        # router pod's grace period follows it (operator/render/router.py)
        timeout_graceful_shutdown=config.shutdown_timeout_s,
        timeout_keep_alive=contract.SERVER_KEEP_ALIVE_S,
    )
    host, port = sock.getsockname()[:2]  # uvicorn names no address when given a socket
    logging.getLogger("kubesgl.router").info("listening on %s", contract.http_url(host, port))
    uvicorn.Server(server_config).run(sockets=[sock])
    return 0
