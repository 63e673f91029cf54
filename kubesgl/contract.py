"""The names and numbers the engine, the router and the operator agree on
(docs/architecture.md, Contracts): default ports, role names, the environment variables of
the keys, pod labels and annotations, the architectures of the tiny model.

Constants and a few pure functions over them (a lookup, a server's URL, what a key must be to
travel in a header, what a label must be), and no imports beyond typing and re: every
component imports this module, the torch-free router and operator included.
"""

from __future__ import annotations

import re
from typing import Final, Literal

# Default ports
ENGINE_PORT: Final = 30000  # `kubesgl serve --port`: the engine's HTTP API
BOOTSTRAP_PORT: Final = (
    8998  # `--disaggregation-bootstrap-port`: a prefill engine's KV bootstrap server
)
ROUTER_PORT: Final = 8000  # `kubesgl router --port`, and the port of the router's Service
# The router's route that answers 200 while its process serves, workers or none: its pods'
# liveness probe (its /health, 503 while no worker can serve, is their readiness)
ROUTER_LIVENESS_PATH: Final = "/liveness"

# Idle HTTP connections: a server keeps one open this long, longer than the client in front of
# it keeps one (load balancers commonly 60 s; the router, towards the engines, ROUTER_UPSTREAM_KEEP_ALIVE_S),
# so that a client never sends a request on a connection its server is closing: that request
# fails (a load balancer's 502; the router sends it again on another connection, which costs a
# round trip). uvicorn's default, 5 s, is shorter than the clients' and lets that happen.
SERVER_KEEP_ALIVE_S: Final = 75
ROUTER_UPSTREAM_KEEP_ALIVE_S: Final = 60

# Seconds requests in flight get to finish after SIGTERM, by default: the engine's and the
# router's --shutdown-timeout alike, so that a router in front of engines started with their
# defaults cuts no stream they would still finish.
SHUTDOWN_TIMEOUT_S: Final = 30

# An X-Request-Id that looks like an id: the router keeps a client's (else it makes one) and
# passes it to the engine, which logs it; one pattern, or the engine drops the router's ids
REQUEST_ID_PATTERN: Final = r"[A-Za-z0-9._:-]{1,128}"

# The most sequences one request may ask of each prompt (its `n`): engines refuse more, and the
# router too, before it draws a bootstrap room for each
MAX_N: Final = 64

# Bootstrap rooms, which tie a request's prefill and decode halves together: the router draws
# each at random, BOOTSTRAP_ROOM_BITS bits, new for every attempt; engines refuse a room outside
# 0 to MAX_BOOTSTRAP_ROOM
BOOTSTRAP_ROOM_BITS: Final = 63
MAX_BOOTSTRAP_ROOM: Final = 2**BOOTSTRAP_ROOM_BITS - 1

# What a prefill or decode engine answers for a room its partner engine failed: the partner
# failed (502) or did not act in time (504). The router reads either as the other side's failure
# passed on; an engine that fails a request by itself answers 500.
PARTNER_FAILED_STATUS: Final = 502
PARTNER_TIMEOUT_STATUS: Final = 504
PARTNER_FAILURE_STATUSES: Final = frozenset({PARTNER_FAILED_STATUS, PARTNER_TIMEOUT_STATUS})

# Seconds a client refused with a 503 (an engine loading, draining or with its queue full; the
# router with no free connection, or every worker it tried busy and none saying when) waits
# before it asks again: the Retry-After of those 503s. A router refused by an engine asks
# another engine at once.
RETRY_AFTER_S: Final = 1

# Roles: an engine's `--role`, and the value of ROLE_LABEL on every pod the operator makes
MIXED: Final = "mixed"  # one engine runs whole requests
PREFILL: Final = "prefill"
DECODE: Final = "decode"
ROUTER: Final = "router"  # the router's own pods; routers never route to them
EngineRole = Literal["mixed", "prefill", "decode"]
PodRole = Literal["mixed", "prefill", "decode", "router"]
ENGINE_ROLES: Final[tuple[EngineRole, ...]] = (MIXED, PREFILL, DECODE)

# Keys given through the environment (the operator fills them from Secrets), so that they are
# in no command line
API_KEY_ENV: Final = "KUBESGL_API_KEY"  # the engines' API key: engines and routers read it
ADMIN_KEY_ENV: Final = "KUBESGL_ROUTER_ADMIN_KEY"  # the key of the router's admin API

# The signal after which the router checks its workers out of the pool at once, not at its next
# health check: `kubesgl up` sends it when an engine turns ready (a name: this module imports
# nothing)
ROUTER_CHECK_SIGNAL: Final = "SIGUSR1"


def bearer_key_problem(key: str) -> str | None:
    """Why no client could send `key` as `Authorization: Bearer KEY`, or None. A header value
    loses its surrounding whitespace on the way in and cannot hold a control character, so such
    a key never matches; most often it is a Secret made from a file that ends with a newline.
    Engines and routers refuse it at start, in these words."""
    if key != key.strip() or not key.isascii() or not key.isprintable():
        return (
            "must be printable ASCII without leading or trailing whitespace (a Secret made "
            "from a file often ends with a newline: `kubectl create secret generic NAME "
            "--from-literal=key=VALUE` has none); no client could send this key in a header"
        )
    return None


# Labels the operator puts on everything it makes; the router finds engine pods by them
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"  # the InferenceService's name
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
ROLE_LABEL: Final = "kubesgl.io/role"

# Kubernetes' rules for label keys and values: a name of up to 63 characters, alphanumeric at
# both ends; a key may have a DNS-subdomain prefix and a slash (apimachinery's IsQualifiedName)
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_key_problem(key: str) -> str | None:
    """Why `key` is no Kubernetes label (or annotation) key, or None."""
    prefix, _, name = key.rpartition("/")
    if not _LABEL_NAME.fullmatch(name) or (
        "/" in key and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix))
    ):
        return (
            f"{key!r} is not a Kubernetes key: an optional DNS-subdomain prefix and '/', then up "
            "to 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is no Kubernetes label value, or None."""
    if value and not _LABEL_NAME.fullmatch(value):
        return (
            f"{value!r} is not a label value: empty, or up to 63 letters, digits, '-', '_' or "
            "'.', beginning and ending with a letter or digit"
        )
    return None


# The header of a prefill or decode engine's /health answer that holds the fingerprint of its
# KV pool's layout (PoolLayout.fingerprint: the layers, a slot's shape, the KV element type and
# the tensor-parallel size), "<scheme>-<hex>". The router pairs a decode worker only with
# prefill workers of its fingerprint, as the prefill engine refuses any other decode engine
# (docs/disaggregation.md, Rollouts); a worker without one (SGLang's engines) pairs with any,
# as does one whose fingerprint is of another scheme (another version's way of making it).
KV_LAYOUT_HEADER: Final = "X-KubeSGL-KV-Layout"
KV_LAYOUT_SCHEME: Final = "kv1"


def kv_layouts_pair(a: str | None, b: str | None) -> bool:
    """Whether engines of KV layout fingerprints `a` and `b` (None: not told) may pair."""
    if a is None or b is None or a.partition("-")[0] != b.partition("-")[0]:
        return True
    return a == b


# A prefill pod's bootstrap port, under kubesgl's name and under SGLang's (SGLang's router
# discovers prefill pods' bootstrap ports by the latter); pods carry both
BOOTSTRAP_PORT_ANNOTATION: Final = "kubesgl.io/bootstrap-port"
SGLANG_BOOTSTRAP_PORT_ANNOTATION: Final = "sglang.ai/bootstrap-port"

# Architectures `kubesgl make-tiny-model --arch` writes: the operator renders that command for
# `spec.model.tiny`, and `kubesgl up` runs it
TinyArch = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"]
TINY_ARCHS: Final[tuple[TinyArch, ...]] = ("llama", "mistral", "qwen2", "qwen3", "qwen3-moe")

# `--log-level` of every command (engine, router, operator), `spec.engine.logLevel` and the
# chart's `logLevel` (its values.schema.json lists them, tests/unit/operator/test_operator_chart.py
# checks it)
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: Final[tuple[LogLevel, ...]] = ("debug", "info", "warning", "error")


# A request without a body: a 400 in the same words from an engine and the router (FastAPI
# reports it as a missing field, json.loads as an error at character 0)
EMPTY_BODY: Final = "the request body is empty: send a JSON object"


def not_json(reason: object) -> str:
    """A 400 in the same words from an engine and the router for a body that JSON's reader
    refused (bad syntax, bytes that are not UTF-8), `reason` the reader's (which byte, where)."""
    return f"the request body is not valid JSON: {reason}"


# How deep a request body may nest arrays and objects (serde_json's default): engines refuse a
# deeper one, which Python's JSON reader takes up to some 1000 levels but pickling it on to the
# tokenizer process does not, from some 500; the router refuses, in the same words, only what
# it cannot read
MAX_BODY_DEPTH: Final = 128
TOO_DEEP_BODY: Final = f"the request body nests arrays and objects more than {MAX_BODY_DEPTH} deep"


def nested_deeper_than(limit: int, value: object) -> bool:
    """Whether parsed JSON nests arrays and objects more than `limit` deep (`{}` is 1). Read
    level by level, each level's arrays and objects only: a prompt's token ids cost one pass."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        level = [
            child
            for v in level
            for child in (v.values() if isinstance(v, dict) else v)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


# OpenAI's routes that engines and the router do not serve, by path prefix: a 404 that says
# so (the same words from either), not "Not Found"
NOT_SERVED: Final = {
    "/v1/responses": "the Responses API (/v1/responses) is not supported by this server; it "
    "serves /v1/chat/completions and /v1/completions",
}


def not_served(path: str) -> str | None:
    """Why `path` is not served, if it is one of NOT_SERVED's routes."""
    return next(
        (why for p, why in NOT_SERVED.items() if path == p or path.startswith(p + "/")), None
    )


# Latency histogram edges in seconds, the engines' and the router's: 1 ms to 2 minutes, at
# most 1.5x apart from 0.1 s to 20 s, where TTFT, queue and prefill times of a loaded service
# fall (histogram_quantile interpolates inside a bucket: with 2.5x steps a p90 read up to 40 %
# high). Every edge of earlier versions is kept, so queries on an `le` value still find it.
LATENCY_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Whole requests (a long generation at a few tokens per second): then up to about 2 hours, as
# vLLM's end-to-end buckets. A latency above the last edge reads as that edge.
REQUEST_BUCKETS_S: Final = LATENCY_BUCKETS_S + (240.0, 300.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0)


def http_url(host: str, port: int) -> str:
    """The base URL of a server at host:port: an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
