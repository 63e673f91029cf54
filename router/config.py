"""Everything `kubesgl router` can be told, with the defaults documented in docs/router.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubesgl import contract
from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV
from kubesgl.router.health import HealthSettings
from kubesgl.router.options import RouterOption, check_bounds, option, options_of
from kubesgl.router.policies import POLICY_NAMES, CacheAwareSettings, PolicyName
from kubesgl.router.routing import DisaggregationSettings, RetrySettings
from kubesgl.router.security import check_key
from kubesgl.router.workers import validate_worker_url


def parse_prefill_spec(spec: str) -> tuple[str, int | None]:
    """`URL[@BOOTSTRAP_PORT]` -> (URL, port or None for the default). Errors never repeat the
    value: what precedes an `@` may be a password."""
    url, sep, port = spec.rpartition("@")
    if not sep:
        return validate_worker_url(spec), None
    if not port.isdigit():  # no port: the `@` belongs to the URL, which says why it is refused
        try:
            validate_worker_url(spec)
        except ValueError as exc:
            raise ValueError(f"bad --prefill URL[@BOOTSTRAP_PORT]: {exc}") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"bad --prefill URL@BOOTSTRAP_PORT: the bootstrap port {port!r} is no port number"
        )
    return validate_worker_url(url), int(port)


def _changed_flags(settings: CacheAwareSettings | DisaggregationSettings) -> list[str]:
    """The flags of the settings set apart from their defaults."""
    return [
        opt.flag for opt in options_of(type(settings)) if getattr(settings, opt.name) != opt.default
    ]


_BREAKER_ERROR = "breaker: failure threshold >= 1 and cooldown >= 0"
_TIMEOUT_ERROR = "timeouts must be positive"


@dataclass(frozen=True)
class KubeDiscoverySettings:
    namespace: str
    selector: dict[str, str]
    worker_port: int = contract.ENGINE_PORT


@dataclass(frozen=True, kw_only=True)  # keywords only: two floats swapped would type-check
class RouterConfig:
    workers: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int | None]] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    policy: PolicyName = "cache_aware"
    prefill_policy: PolicyName | None = None  # None: same as `policy`
    decode_policy: PolicyName | None = None  # None: same as `policy`
    cache_aware: CacheAwareSettings = field(default_factory=CacheAwareSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    disaggregation: DisaggregationSettings = field(default_factory=DisaggregationSettings)
    breaker_failure_threshold: int = option(
        5,
        flag="--breaker-failure-threshold",
        help="consecutive failed requests that open a worker's circuit",
        error=_BREAKER_ERROR,
        ge=1,
    )
    breaker_cooldown_s: float = option(
        10.0,
        flag="--breaker-cooldown",
        help="seconds an open circuit keeps a worker out",
        error=_BREAKER_ERROR,
        ge=0,
    )
    connect_timeout_s: float = option(
        5.0,
        flag="--connect-timeout",
        help="seconds to open a connection to a worker, and the longest wait for a free one "
        "(--max-connections) before the request is answered 503",
        error=_TIMEOUT_ERROR,
        gt=0,
    )
    request_timeout_s: float = option(
        1800.0,
        flag="--request-timeout",
        help="longest wait for the next byte of a worker's answer",
        error=_TIMEOUT_ERROR,
        gt=0,
    )
    max_connections: int = option(
        4096,
        flag="--max-connections",
        help="requests open to all workers together (health checks aside); one more waits "
        "for a free connection; at least 2, the two a prefill/decode request takes at once",
        error="the connection limit must be at least 2: a prefill/decode request takes two at once",
        ge=2,
    )
    shutdown_timeout_s: int = option(
        contract.SHUTDOWN_TIMEOUT_S,
        flag="--shutdown-timeout",
        help="seconds streams still running get to finish after SIGTERM; one cut then ends with "
        "an SSE error event and [DONE]",
        error="the shutdown timeout must be at least 1 s",
        ge=1,
    )
    max_request_bytes: int = 64 * 1024 * 1024
    # Opens the admin endpoints that change the pool (POST/DELETE /workers); None: they answer 403.
    admin_api_key: str | None = None
    # The engines' API key: clients must present it, and the router presents it to engines in
    # place of the client's credentials. None: no check, and engines get no Authorization.
    api_key: str | None = None
    kube: KubeDiscoverySettings | None = None

    def __post_init__(self) -> None:
        for policy in (self.policy, self.prefill_policy, self.decode_policy):
            if policy is not None and policy not in POLICY_NAMES:
                raise ValueError(
                    f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}"
                )
        if self.workers and (self.prefill or self.decode):
            raise ValueError("give either --worker (mixed) or --prefill/--decode (P/D), not both")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("P/D mode needs at least one --prefill and one --decode worker")
        check_bounds(self)  # the breaker's, the timeouts and the connection limit
        for urls in (self.workers, self.decode, [url for url, _ in self.prefill]):
            for url in urls:
                validate_worker_url(url)
        for name, key in ((ADMIN_KEY_ENV, self.admin_api_key), (API_KEY_ENV, self.api_key)):
            if key is not None:
                check_key(name, key)

    def ignored_options(self) -> list[str]:
        """Why an option given has no effect with these workers and policies, a line each, for a
        warning at start (SGLang's router takes such combinations too; an operator's spec may
        keep an option across a change of policy)."""
        mixed_only = bool(self.workers) and self.kube is None  # or the admin API's, rarely P/D
        notes = []
        if mixed_only:
            sides = (("prefill", self.prefill_policy), ("decode", self.decode_policy))
            pd_flags = [f"--{side}-policy" for side, policy in sides if policy is not None]
            notes = [
                f"{flag} has no effect: it applies to prefill/decode workers, and only mixed "
                "ones (--worker) are given"
                for flag in pd_flags + _changed_flags(self.disaggregation)
            ]
        policies = {self.policy}
        if not mixed_only:
            policies |= {self.prefill_policy or self.policy, self.decode_policy or self.policy}
        if "cache_aware" not in policies:
            notes += [
                f"{flag} has no effect: it tunes the cache_aware policy, and workers are chosen "
                f"by {' and '.join(sorted(policies))}"
                for flag in _changed_flags(self.cache_aware)
            ]
        return notes


# Every option declared on a settings field (router/options.py), by flag: the command line's
# numeric flags, and the operator's spec.router fields named like them (operator/spec.py).
ROUTER_OPTIONS: dict[str, RouterOption] = {
    opt.flag: opt
    for settings in (
        CacheAwareSettings,
        DisaggregationSettings,
        HealthSettings,
        RetrySettings,
        RouterConfig,
    )
    for opt in options_of(settings)
}
