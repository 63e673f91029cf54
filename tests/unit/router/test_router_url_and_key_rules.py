"""Issue 11, item 3 (router): the admin and client keys, worker URL rules, credentials to engines.

Addresses here are only parsed, never connected to: the link-local and metadata ones appear as
text, and the resolvers are fakes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket

import pytest

from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV
from kubesgl.router import security
from kubesgl.router.cli import build_parser, check_router_args, config_from_args
from kubesgl.router.config import RouterConfig, parse_prefill_spec
from kubesgl.router.discovery import PodWatcher
from kubesgl.router.security import (
    BearerKey,
    GuardedResolver,
    check_key,
    host_problem,
    resolved_problem,
)
from kubesgl.router.upstream import UpstreamError, forwarded_headers, make_session
from kubesgl.router.workers import Role, WorkerRegistry, validate_worker_url

ALLOWED = [
    "http://127.0.0.1:30000", "127.0.0.1:30000", "http://localhost:30000", "https://engine.llm.svc:443",
    "http://[::1]:30000", "http://10.0.0.7:30000", "http://169.255.0.1:1",
    "http://[fd00:ec2::253]:1", "http://metadata-cache.internal:1", "http://[fec0::1]:1",
]  # fmt: skip

LINK_LOCAL = [
    "http://169.254.0.1:30000", "http://169.254.255.254:1", "http://[fe80::1]:30000", "http://[fe80::1%25eth0]:1",
    "http://[febf::1]:1", "http://[::ffff:169.254.1.1]:1",
]  # fmt: skip

METADATA = [
    "http://169.254.169.254", "http://169.254.169.254:80", "http://[fd00:ec2::254]:80",
    "http://metadata.google.internal", "http://METADATA.Google.Internal.:80", "http://metadata:80",
    "http://metadata.:80",
    # other spellings of 169.254.169.254 a resolver takes as that address
    "http://2852039166:80", "http://0xa9fea9fe:80", "http://0251.0376.0251.0376:80", "http://169.254.43518:80",
    "http://169.254.169.254.:80", "http://[::ffff:169.254.169.254]:80", "http://[::ffff:a9fe:a9fe]:80",
    "http://[64:ff9b::a9fe:a9fe]:80", "http://[::169.254.169.254]:80",
]  # fmt: skip


@pytest.mark.parametrize("url", ALLOWED)
def test_ordinary_worker_urls_are_accepted(url):
    assert validate_worker_url(url).startswith(("http://", "https://"))


@pytest.mark.parametrize("url", LINK_LOCAL)
def test_link_local_hosts_are_refused(url):
    with pytest.raises(ValueError, match="link-local"):
        validate_worker_url(url)


@pytest.mark.parametrize("url", METADATA)
def test_cloud_metadata_hosts_are_refused(url):
    with pytest.raises(ValueError, match="metadata"):
        validate_worker_url(url)


@pytest.mark.parametrize(
    "url", ["ftp://h:1", "file:///etc/passwd", "gopher://h:70", "unix:///tmp/s", "ws://h:1"]
)
def test_only_http_and_https(url):
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        validate_worker_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://admin:hunter2@127.0.0.1:1",
        "http://hunter2@127.0.0.1:1",
        "admin:hunter2@127.0.0.1:1",
        "https://:hunter2@h:1",
        "ftp://u:hunter2@h:1",
    ],
)
def test_credentials_in_a_url_are_refused_and_never_repeated(url):
    with pytest.raises(ValueError, match="no user name or password") as refused:
        validate_worker_url(url)
    assert "hunter2" not in str(refused.value)


def test_every_way_in_applies_the_rules():
    # command line: --worker, --decode, --prefill (with and without a bootstrap port)
    for field in ("workers", "decode"):
        other = {"workers": {}, "decode": {"prefill": [("http://p:1", None)]}}[field]
        with pytest.raises(ValueError, match="metadata"):
            RouterConfig(**{field: ["http://169.254.169.254:80"]}, **other)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="link-local"):
        RouterConfig(prefill=[("http://[fe80::1]:1", None)], decode=["http://d:1"])
    for spec in ("http://169.254.169.254:80@8998", "http://169.254.169.254:80"):
        with pytest.raises(ValueError, match="metadata"):
            parse_prefill_spec(spec)
    for spec in ("http://u:hunter2@p:1@8998", "http://u:hunter2@p:1", "http://u:hunter2@p:1@99999"):
        with pytest.raises(ValueError) as refused:
            parse_prefill_spec(spec)
        assert "hunter2" not in str(refused.value)
    assert parse_prefill_spec("http://127.0.0.1:1@8998") == ("http://127.0.0.1:1", 8998)
    # the registry, which the admin API and discovery go through as well
    registry = WorkerRegistry()
    with pytest.raises(ValueError, match="metadata"):
        registry.add("http://metadata.google.internal:80", Role.MIXED)
    assert registry.all() == []


def test_discovery_leaves_out_a_pod_with_a_link_local_ip():
    registry = WorkerRegistry()
    watcher = PodWatcher(registry, "llm", {"app": "x"})

    def pod(name: str, ip: str) -> dict:
        return {"metadata": {"name": name, "labels": {"app": "x"}},
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip

    watcher._on_event({"type": "ADDED", "object": pod("bad", "169.254.3.4")})
    watcher._on_event({"type": "ADDED", "object": pod("good", "10.1.2.3")})
    assert [w.url for w in registry.all()] == ["http://10.1.2.3:30000"]


def test_resolved_addresses_are_checked():
    assert resolved_problem("engine", ["127.0.0.1", "::1"]) is None
    assert "169.254.169.254, a cloud metadata address" in resolved_problem(
        "evil", ["127.0.0.1", "169.254.169.254"]
    )
    assert "link-local" in resolved_problem("evil", ["fe80::1%2"])
    assert host_problem("engine.llm.svc.cluster.local") is None  # a name: the admin API resolves it


class FakeResolver:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": 0} for a in self.answers[host]]  # fmt: skip

    async def close(self):
        pass


def test_the_connection_pool_never_resolves_a_name_to_a_forbidden_address():
    """DNS rebinding: a name that passed the admin API's check may answer differently later."""
    resolver = GuardedResolver(FakeResolver({  # type: ignore[arg-type]
        "mixed.test": ["169.254.169.254", "127.0.0.1", "fe80::1%3"], "rebound.test": ["169.254.169.254"],
        "fine.test": ["127.0.0.1"],
    }))  # fmt: skip

    async def scenario():
        assert [r["host"] for r in await resolver.resolve("mixed.test", 80)] == ["127.0.0.1"]
        assert [r["host"] for r in await resolver.resolve("fine.test", 80)] == ["127.0.0.1"]
        with pytest.raises(OSError, match="169.254.169.254"):
            await resolver.resolve("rebound.test", 80)
        session = make_session(1.0, 1.0)
        try:
            assert isinstance(session.connector._resolver, GuardedResolver)  # type: ignore[union-attr]
        finally:
            await session.close()

    asyncio.run(scenario())


def test_bearer_keys_are_compared_in_constant_time(monkeypatch):
    compared = []
    compare_digest = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    key = BearerKey("s3cret")
    assert key.admits([(b"authorization", b"Bearer s3cret")])
    assert key.admits([(b"authorization", b"bearer s3cret")])  # the scheme is case-insensitive
    assert len(compared) == 2 and all(
        len(a) == len(b) == 32 for a, b in compared
    )  # digests: no length leak
    for headers in ([], [(b"authorization", b"Bearer s3cre")], [(b"authorization", b"Bearer s3crett")],
                    [(b"authorization", b"Basic s3cret")], [(b"authorization", b"s3cret")],
                    [(b"authorization", b"Bearer s3cret"), (b"authorization", b"Bearer other")]):  # fmt: skip
        assert not key.admits(headers), headers
    assert key.header == (b"authorization", b"Bearer s3cret")


@pytest.mark.parametrize("bad", ["", "key\n", " key", "k\x00ey", "clé"])
def test_keys_no_client_could_send_are_refused(bad):
    with pytest.raises(ValueError):
        check_key(ADMIN_KEY_ENV, bad)
    with pytest.raises(ValueError):
        RouterConfig(api_key=bad)


def test_keys_come_from_the_environment():
    parser = build_parser()
    config = config_from_args(parser.parse_args([]), {ADMIN_KEY_ENV: "adm", API_KEY_ENV: "eng"})
    assert (config.admin_api_key, config.api_key) == ("adm", "eng")
    # --admin-api-key still works (SGLang's router has it)
    config = config_from_args(parser.parse_args(["--admin-api-key", "flag"]), {})
    assert (config.admin_api_key, config.api_key) == ("flag", None)
    worker = ["--worker", "http://engine:30000"]
    assert config_from_args(parser.parse_args(worker), {}).admin_api_key is None  # admin closed
    # no worker and no admin key: none could ever be added, and `kubesgl router` refuses
    # that at start (the operator's check of a router pod's command line with it)
    with pytest.raises(ValueError, match="no workers, and no way to add one"):
        check_router_args([], {})
    with pytest.raises(ValueError, match="not both"):
        config_from_args(parser.parse_args(["--admin-api-key", "flag"]), {ADMIN_KEY_ENV: "adm"})
    # a variable that is set holds a key: an empty Secret must not turn the client check off
    for name in (ADMIN_KEY_ENV, API_KEY_ENV):
        for bad in ("", "key\n"):
            with pytest.raises(ValueError, match=name):
                config_from_args(parser.parse_args([]), {name: bad})
    with pytest.raises(ValueError, match="--admin-api-key is empty"):
        config_from_args(parser.parse_args(["--admin-api-key", ""]), {})


def test_engines_get_the_routers_credentials_never_the_clients():
    client = [(b"host", b"router"), (b"authorization", b"Bearer client-key"), (b"Authorization", b"Basic x"),
              (b"cookie", b"session=1"), (b"content-type", b"application/json"), (b"x-request-id", b"7")]  # fmt: skip
    assert forwarded_headers(client, []) == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"7"),
    ]
    mine = [BearerKey("engine-key").header]
    assert forwarded_headers(client, mine) == [
        (b"content-type", b"application/json"), (b"x-request-id", b"7"), (b"authorization", b"Bearer engine-key"),
    ]  # fmt: skip


def test_headers_a_connection_header_names_are_the_connections_and_stay_behind():
    client = [(b"connection", b"keep-alive, X-Hop"), (b"x-hop", b"1"), (b"x-request-id", b"7")]
    assert forwarded_headers(client, []) == [(b"x-request-id", b"7")]


def test_an_engine_refusing_the_routers_key_is_a_gateway_error_naming_the_variable():
    worker = WorkerRegistry().add("http://127.0.0.1:1", Role.MIXED)
    body = json.dumps(
        {"error": {"message": "missing or wrong API key", "type": "authentication_error"}}
    ).encode()
    error = UpstreamError.from_answer(worker, 401, body)
    assert error.status == 502 and not error.retryable
    assert API_KEY_ENV in error.message and worker.url in error.message
    assert json.loads(error.body())["error"]["code"] is None


def test_a_pod_that_goes_never_takes_away_a_worker_it_does_not_own():
    """A new pod may get a gone pod's IP before the watch reports the old one gone, and a
    static --worker may share a pod's address: removing the old pod removes neither."""
    registry = WorkerRegistry()
    registry.add("http://10.1.2.9:30000", Role.MIXED)  # --worker
    watcher = PodWatcher(registry, "llm", {"app": "x"})

    def pod(name: str, ip: str) -> dict:
        return {"metadata": {"name": name, "labels": {"app": "x"}},
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip

    watcher._on_event({"type": "ADDED", "object": pod("a", "10.1.2.3")})
    watcher._on_event({"type": "ADDED", "object": pod("b", "10.1.2.3")})  # a's IP, reused
    watcher._on_event({"type": "DELETED", "object": pod("a", "10.1.2.3")})
    watcher._on_event({"type": "ADDED", "object": pod("c", "10.1.2.9")})
    watcher._on_event({"type": "DELETED", "object": pod("c", "10.1.2.9")})
    assert sorted(w.url for w in registry.all()) == [
        "http://10.1.2.3:30000",
        "http://10.1.2.9:30000",
    ]
    assert registry.get("http://10.1.2.9:30000").source == "static"
    watcher._on_event({"type": "DELETED", "object": pod("b", "10.1.2.3")})
    assert [w.url for w in registry.all()] == ["http://10.1.2.9:30000"]
