import os
import socket

import pytest

from kubesgl.contract import ADMIN_KEY_ENV
from kubesgl.router.cli import build_parser, config_from_args
from kubesgl.router.config import RouterConfig, parse_prefill_spec
from kubesgl.router.discovery import parse_selector, worker_from_pod
from kubesgl.router.health import HealthSettings
from kubesgl.router.policies import CacheAwareSettings
from kubesgl.router.routing import DisaggregationSettings, RetrySettings
from kubesgl.router.workers import Role, WorkerRegistry, normalize_url


def test_prefill_spec_and_urls():
    assert parse_prefill_spec("http://p:30000@9000") == ("http://p:30000", 9000)
    assert parse_prefill_spec("p:30000") == ("http://p:30000", None)
    with pytest.raises(ValueError):
        parse_prefill_spec("http://p:30000@port")
    assert normalize_url("http://h:1/") == "http://h:1"
    for bad in ("ftp://h:1", "http://h:1/v1", "http://h:port"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_cli_builds_the_config_and_rejects_mixed_modes():
    args = build_parser().parse_args(
        ["--prefill", "http://p:1@9000", "--decode", "http://d:1", "--policy", "round_robin",
         "--decode-policy", "power_of_two", "--cache-threshold", "0.7", "--kube-selector", "a=b", "c=d"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.prefill == [("http://p:1", 9000)] and config.decode == ["http://d:1"]
    assert (config.policy, config.decode_policy, config.cache_aware.cache_threshold) == (
        "round_robin",
        "power_of_two",
        0.7,
    )
    assert config.kube is not None and config.kube.selector == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(workers=["http://w:1"], prefill=[("http://p:1", None)], decode=["http://d:1"])
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        RouterConfig(prefill=[("http://p:1", None)])
    with pytest.raises(ValueError):
        parse_selector(["novalue"])


def test_kube_selector_takes_kubectls_comma_form():
    """`a=b,c=d` is two selectors, as kubectl reads it, not a=`b,c=d`, which matched no pod."""
    args = build_parser().parse_args(
        ["--kube-selector", "a=b,c=d", "e==f", "--kube-namespace", "n"]
    )
    selector = config_from_args(args).kube.selector
    assert selector == {"a": "b", "c": "d", "e": "f"}
    labels = {"a": "b", "c": "d", "e": "f"}
    assert worker_from_pod(pod(labels=labels), selector, 30000) is not None
    assert parse_selector(["example.com/app = x , tier="]) == {"example.com/app": "x", "tier": ""}


@pytest.mark.parametrize(
    "item",
    ["novalue", "a=b,", ",a=b", "=b", "a!=b", "a===b", "a=b c", "a in (x)", "a-=b", "a=b/c",
     "a=" + "v" * 64, "Bad_Prefix/a=b"],
)  # fmt: skip
def test_kube_selector_refuses_what_is_no_equality_selector(item, monkeypatch, capsys):
    import uvicorn

    from kubesgl.router import cli

    def serve(app, **kwargs):
        raise AssertionError(f"the router started with --kube-selector {item!r}")

    monkeypatch.setattr(uvicorn, "run", serve)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--kube-selector", item])
    assert exited.value.code == 2
    reason = capsys.readouterr().err.splitlines()[-1]
    assert reason.startswith(f"kubesgl router: error: --kube-selector {item!r}: "), reason
    if "!=" in item or "(" in item:  # was "'a!' is not a Kubernetes key"
        assert reason.endswith("only equality selectors are taken (KEY=VALUE), not !=, in or notin")


def test_kube_selector_refuses_one_key_with_two_values():
    """The API server would match neither value (both must hold); the router took the last."""
    with pytest.raises(ValueError, match="'a'.*twice"):
        parse_selector(["a=b", "a=c"])
    assert parse_selector(["a=b", "a=b"]) == {"a": "b"}


def pod(role="mixed", *, ready=True, ip="10.0.0.7", annotations=None, labels=None, deleting=False):
    meta = {"name": "p", "labels": {"app": "x", "kubesgl.io/role": role, **(labels or {})},
            "annotations": annotations or {}}  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {"phase": "Running" if ready else "Pending", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}  # fmt: skip
    return {
        "metadata": meta,
        "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 9}]}]},
        "status": status,
    }


def test_the_flags_defaults_are_the_configs():
    """Declared once, in RouterConfig and its settings: the command line reads them there."""
    admin = {ADMIN_KEY_ENV: "adm"}  # a router with no worker takes one (or refuses to start)
    assert config_from_args(build_parser().parse_args([]), admin) == RouterConfig(
        admin_api_key="adm"
    )


# Each numeric flag, a value no other one gets, and where it lands in RouterConfig
FLAG_FIELDS = {
    "--cache-threshold": ("0.25", "cache_aware.cache_threshold"),
    "--balance-abs-threshold": ("11", "cache_aware.balance_abs_threshold"),
    "--balance-rel-threshold": ("2.5", "cache_aware.balance_rel_threshold"),
    "--max-tree-chars": ("12", "cache_aware.max_tree_chars"),
    "--pd-min-prefill-tokens": ("13", "disaggregation.min_prefill_tokens"),
    "--pd-max-prefill-in-flight": ("14", "disaggregation.max_prefill_in_flight"),
    "--health-check-interval": ("6.5", "health.interval_s"),
    "--health-check-timeout": ("1.5", "health.timeout_s"),
    "--health-failure-threshold": ("15", "health.failure_threshold"),
    "--health-success-threshold": ("16", "health.success_threshold"),
    "--breaker-failure-threshold": ("17", "breaker_failure_threshold"),
    "--breaker-cooldown": ("7.5", "breaker_cooldown_s"),
    "--max-retries": ("18", "retry.max_retries"),
    "--retry-initial-backoff": ("0.125", "retry.initial_backoff_s"),
    "--retry-max-backoff": ("3.5", "retry.max_backoff_s"),
    "--connect-timeout": ("8.5", "connect_timeout_s"),
    "--request-timeout": ("9.5", "request_timeout_s"),
    "--max-connections": ("19", "max_connections"),
}


def test_each_flag_sets_its_own_field():
    """Two floats swapped between flags and fields would type-check: each value is followed."""
    argv = [arg for flag, (value, _) in FLAG_FIELDS.items() for arg in (flag, value)]
    config = config_from_args(build_parser().parse_args(argv), {ADMIN_KEY_ENV: "adm"})
    for flag, (value, path) in FLAG_FIELDS.items():
        field = config
        for name in path.split("."):
            field = getattr(field, name)
        assert field == type(field)(value), flag


@pytest.mark.parametrize(
    "settings",
    [CacheAwareSettings, HealthSettings, RetrySettings, DisaggregationSettings, RouterConfig],
)
def test_settings_take_keywords_only(settings):
    with pytest.raises(TypeError):
        settings(1)


def test_worker_from_pod():
    selector = {"app": "x"}
    worker = worker_from_pod(pod(), selector, 30000)
    assert worker is not None and (worker.url, worker.role) == ("http://10.0.0.7:30000", Role.MIXED)
    prefill = worker_from_pod(
        pod("prefill", annotations={"kubesgl.io/bootstrap-port": "9001"}), selector, 30000
    )
    assert prefill is not None and prefill.bootstrap_port == 9001
    assert worker_from_pod(pod("prefill"), selector, 30000).bootstrap_port == 8998
    sglang = worker_from_pod(
        pod("prefill", annotations={"sglang.ai/bootstrap-port": "9002"}), selector, 30000
    )
    assert (
        sglang is not None and sglang.bootstrap_port == 9002
    )  # pods annotated for SGLang's router
    both = {"kubesgl.io/bootstrap-port": "9001", "sglang.ai/bootstrap-port": "9002"}
    assert worker_from_pod(pod("prefill", annotations=both), selector, 30000).bootstrap_port == 9001
    assert worker_from_pod(pod(ip="fd00::1"), selector, 1).url == "http://[fd00::1]:1"
    for excluded in (pod(ready=False), pod(ip=""), pod(deleting=True), pod("router"),
                     pod(labels={"app": "y"}), pod("prefill", annotations={"kubesgl.io/bootstrap-port": "x"})):  # fmt: skip
        assert worker_from_pod(excluded, selector, 30000) is None


def test_registry_replaces_a_worker_whose_role_changed_and_reports_mode():
    registry = WorkerRegistry()
    removed = []
    registry.on_removed(removed.append)
    first = registry.add("http://w:1", Role.MIXED)
    assert registry.add("http://w:1/", Role.MIXED) is first
    assert not registry.is_disaggregated()
    second = registry.add("http://w:1", Role.PREFILL)
    assert removed == [first] and second.bootstrap_port == 8998 and registry.is_disaggregated()
    assert registry.add("http://d:1", Role.DECODE, 1234).bootstrap_port is None


def test_mixed_workers_serve_while_a_new_prefill_decode_pool_has_no_pair_yet():
    """A switch between modes (the operator keeps the old pool until the new one is ready):
    the pods of the new pool join one by one, and a prefill worker alone cannot serve, so the
    healthy mixed workers do until a prefill and a decode worker both can; and the other way
    round, a prefill/decode pool that still serves keeps the requests while mixed pods join."""
    registry = WorkerRegistry()
    mixed = registry.add("http://m:1", Role.MIXED)
    registry.set_healthy(mixed, True)
    prefill = registry.add("http://p:1", Role.PREFILL)
    registry.set_healthy(prefill, True)
    assert not registry.is_disaggregated()  # no decode worker yet: mixed serves
    decode = registry.add("http://d:1", Role.DECODE)
    assert not registry.is_disaggregated()  # registered, not yet healthy
    registry.set_healthy(decode, True)
    assert registry.is_disaggregated()  # a pair can serve
    registry.set_healthy(mixed, False)
    assert registry.is_disaggregated()
    registry.set_healthy(decode, False)
    assert registry.is_disaggregated()  # nothing else can serve: P/D, as configured


def _config(*argv: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(list(argv)), {})


def test_options_that_have_no_effect_are_named_with_the_reason():
    """P/D options with only mixed workers, and the cache-aware options without a cache_aware
    policy, were taken and ignored without a word."""
    mixed = ("--worker", "http://w:1", "--policy", "round_robin")
    pd_and_cache = ("--pd-min-prefill-tokens", "0", "--decode-policy", "cache_aware")
    assert _config(*mixed, *pd_and_cache, "--cache-threshold", "0.5").ignored_options() == [
        "--decode-policy has no effect: it applies to prefill/decode workers, and only mixed ones "
        "(--worker) are given",
        "--pd-min-prefill-tokens has no effect: it applies to prefill/decode workers, and only "
        "mixed ones (--worker) are given",
        "--cache-threshold has no effect: it tunes the cache_aware policy, and workers are chosen "
        "by round_robin",
    ]
    pd = ("--prefill", "http://p:1", "--decode", "http://d:1", "--policy", "random")
    assert _config(
        *pd, "--max-tree-chars", "5", "--prefill-policy", "round_robin"
    ).ignored_options() == [
        "--max-tree-chars has no effect: it tunes the cache_aware policy, and workers are chosen "
        "by random and round_robin"
    ]
    # an option some policy or worker uses, or one left at its default, is no news
    for argv in (
        (*pd, "--decode-policy", "cache_aware", "--cache-threshold", "0.5"),
        ("--kube-selector", "a=b", "--pd-min-prefill-tokens", "0"),  # pods of any role may come
        (*mixed, "--cache-threshold", "0.3"),
        ("--worker", "http://w:1"),
    ):
        assert _config(*argv).ignored_options() == [], argv


def test_the_router_warns_of_options_without_effect_at_start(monkeypatch, capsys):
    """Served on a socket of its own (--fd): it failed where --port 23017 was taken."""
    import uvicorn

    from kubesgl.router import cli

    served: list[socket.socket] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: served.extend(sockets))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        fd = str(os.dup(listener.fileno()))  # the router's socket closes its own copy
        argv = ["--worker", "http://w:1", "--pd-max-prefill-in-flight", "8", "--fd", fd]
        assert cli.main(argv) == 0
    (sock,) = served
    sock.close()
    assert capsys.readouterr().err.splitlines() == [
        "kubesgl router: --pd-max-prefill-in-flight has no effect: it applies to prefill/decode "
        "workers, and only mixed ones (--worker) are given"
    ]


def test_the_admin_api_does_not_remove_a_worker_that_discovery_follows():
    """DELETE /workers removed a discovered worker for good: its pod, still ready, stayed in the
    watcher's pods, and no re-list brought it back. The pool follows the cluster instead: the
    admin API refuses, naming how to take the pod out."""
    import asyncio

    from kubesgl.router.app import RouterApp
    from kubesgl.router.discovery import PodWatcher
    from kubesgl.router.errors import RouterError

    app = RouterApp(RouterConfig(admin_api_key="adm"))
    watcher = PodWatcher(app.workers, "llm", {"app": "x"})
    pod = {"metadata": {"name": "eng-0", "labels": {"app": "x"}},
           "status": {"phase": "Running", "podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    watcher._apply("eng-0", pod)
    app.workers.add("http://10.1.2.4:30000", Role.MIXED, source="admin")

    def delete(url: str):
        return asyncio.run(app._remove_worker({"query_string": f"url={url}".encode()}, b""))

    with pytest.raises(RouterError) as refused:
        delete("http://10.1.2.3:30000")
    assert refused.value.status == 409 and "eng-0" in refused.value.message
    assert "ready" in refused.value.message and "--kube-selector" in refused.value.message
    watcher._apply("eng-0", pod)  # a re-list
    assert [w.url for w in app.workers.all()][0] == "http://10.1.2.3:30000"
    assert delete("http://10.1.2.4:30000").status == 200  # an admin-added worker goes
    assert [w.url for w in app.workers.all()] == ["http://10.1.2.3:30000"]


def test_the_router_refuses_a_port_in_use_at_start(monkeypatch, capsys):
    """It bound its port only in uvicorn's startup, and a port in use ended it with status 3
    and "Application shutdown complete" as its last line, which `kubesgl up` restarted forever;
    now it is one line and status 2 before anything starts, as from `kubesgl serve`."""
    import socket

    import uvicorn

    from kubesgl.router import cli

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: pytest.fail("it served"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--worker", "http://w:1", "--port", str(port)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kubesgl router: --port {port}: port {port} on 127.0.0.1 is already in use "
        "(another server?); choose another port"
    ]


@pytest.mark.parametrize("address", [["--host", "0.0.0.0"], ["--port", "9000"]])
def test_a_socket_to_serve_takes_no_address_beside_it(monkeypatch, capsys, address):
    """--fd beside --host or --port served the socket and ignored them without a word."""
    import uvicorn

    from kubesgl.router import cli

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: pytest.fail("it served"))
    argv = ["--worker", "http://w:1", "--fd", "3", *address]
    with pytest.raises(ValueError, match="give --host and --port, or --fd, not both"):
        cli.check_router_args(argv, {})
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kubesgl router: error: --fd 3 serves a socket that listens already: give --host and "
        "--port, or --fd, not both"
    )


def test_a_socket_to_serve_must_listen(monkeypatch, capsys):
    """A bound socket that does not listen was served, and uvicorn failed on its first
    accept, after the app's startup."""
    import uvicorn

    from kubesgl.router import cli

    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: pytest.fail("it served"))
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        fd = os.dup(bound.fileno())  # the router closes its copy
        assert cli.main(["--worker", "http://w:1", "--fd", str(fd)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kubesgl router: --fd {fd}: a socket that does not listen (bound, connected?)"
    ]
