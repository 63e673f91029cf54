"""The alerting rules the chart ships (charts/kubesgl/alerts): generated from their script,
every expression valid PromQL reading metrics kubesgl exports, and, run by promtool on
synthetic series, each alert fires where it should and stays silent where it should not."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml
from test_dashboard import exported_metric_names, load_script

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "charts" / "kubesgl" / "alerts"
RULES = ALERTS / "kubesgl.rules.yaml"
PROMTOOL = shutil.which("promtool")  # Debian's prometheus package ships it
# .ci/run installs Prometheus and sets this, so that CI fails rather than skips if the install broke.
REQUIRED = os.environ.get("KUBESGL_REQUIRE_PROMETHEUS") == "1"
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not REQUIRED,
    reason="needs promtool (apt-get install prometheus)",
)


def builder():
    return load_script(ALERTS / "build_alerts.py")


def rules() -> list[dict]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return group["rules"]


def test_committed_rules_are_the_generated_ones():
    assert RULES.read_text() == builder().render()


def test_every_expression_parses_as_promql():
    for rule in rules():
        promql_parser.parse(rule["expr"])  # raises on a syntax error


def test_every_metric_the_alerts_read_is_exported():
    exported = exported_metric_names()
    read = {
        name
        for rule in rules()
        # kubesgl_io_role is a label: the pods' kubesgl.io/role, which the PodMonitor copies
        for name in re.findall(r"\bkubesgl_(?!io_role\b)[a-z0-9_]+", rule["expr"])
    }
    assert read and read <= exported, sorted(read - exported)


def test_every_alert_says_how_long_how_bad_and_where_to_look():
    names = [rule["alert"] for rule in rules()]
    assert len(set(names)) == len(names)
    docs = (ROOT / "docs" / "operator.md").read_text()
    for rule in rules():
        assert re.fullmatch(r"\d+m", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert "$labels.app_kubernetes_io_instance" in rule["annotations"]["summary"]
        assert "docs/operator.md#alerts" in rule["annotations"]["description"]
        assert f"`{rule['alert']}`" in docs, f"docs/operator.md's table lacks {rule['alert']}"
        # a counter is read through rate(), or only for its labels (group); a gauge never rated
        for read in re.finditer(r"\bkubesgl_(?!io_role\b)[a-z0-9_]+", rule["expr"]):
            before = rule["expr"][: read.start()]
            rated = before.endswith("rate(")
            if read.group().endswith("_total"):
                assert rated or re.search(r"group by \([^)]*\) \($", before), read.group()
            else:
                assert not rated, read.group()


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        raise RuntimeError("KUBESGL_REQUIRE_PROMETHEUS=1 but no promtool binary is on PATH")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_the_rules_and_their_templates():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def series(metric: str, values: str, **labels: str) -> dict:
    matchers = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{metric}{{{matchers}}}", "values": values}


def router(instance: str, metric: str, values: str, pod: str = "router-0", **labels: str) -> dict:
    return series(
        metric,
        values,
        namespace="ns",
        app_kubernetes_io_instance=instance,
        kubesgl_io_role="router",
        pod=pod,
        **labels,
    )


def worker(instance: str, url: str, role: str, healthy: str, pod: str = "router-0") -> list[dict]:
    """A worker as one router replica exports it: its health, its info, and the
    requests_total{worker=""} series every router has from its start."""
    return [
        router(instance, "kubesgl_router_worker_healthy", healthy, pod, worker=url),
        router(
            instance,
            "kubesgl_router_worker_info",
            "1x30",
            pod,
            worker=url,
            role=role,
            worker_pod="",
            model_name="m",
        ),
    ]


def router_up(instance: str, pod: str = "router-0") -> dict:
    return router(instance, "kubesgl_router_requests_total", "0x30", pod, status="503")


def fires(instance: str, severity: str, **labels: str) -> dict:
    return {
        "exp_labels": {
            "severity": severity,
            "namespace": "ns",
            "app_kubernetes_io_instance": instance,
            **labels,
        }
    }


def worker_cases() -> dict:
    return {
        "interval": "1m",
        "input_series": [
            # down: its one worker unhealthy; empty: discovery found no worker at all
            router_up("down"),
            *worker("down", "http://w1", "mixed", "0x30"),
            router_up("empty"),
            # fine: one router replica sees its worker unhealthy, the other healthy
            router_up("fine"),
            *worker("fine", "http://w1", "mixed", "0x30"),
            router_up("fine", "router-1"),
            *worker("fine", "http://w1", "mixed", "1x30", "router-1"),
            # flap: unhealthy for a minute only
            router_up("flap"),
            *worker("flap", "http://w1", "mixed", "1 1 0 1x30"),
            # P/D: prefill healthy, decode not (nodecode); both healthy (pd)
            router_up("nodecode"),
            *worker("nodecode", "http://p1", "prefill", "1x30"),
            *worker("nodecode", "http://d1", "decode", "0x30"),
            router_up("pd"),
            *worker("pd", "http://p1", "prefill", "1x30"),
            *worker("pd", "http://d1", "decode", "1x30"),
            *worker("pd", "http://d2", "decode", "0x30"),
            # P/D whose decode pods discovery dropped (not ready): only prefill workers left
            router_up("gone"),
            *worker("gone", "http://p1", "prefill", "1x30"),
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "KubesglRouterNoHealthyWorker", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "KubesglRouterNoHealthyWorker",
                "exp_alerts": [fires("down", "critical"), fires("empty", "critical")],
            },
            {"eval_time": "1m", "alertname": "KubesglRouterNoDecodeWorker", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "KubesglRouterNoDecodeWorker",
                "exp_alerts": [fires("nodecode", "critical"), fires("gone", "critical")],
            },
        ],
    }


def error_cases() -> dict:
    """Counters per minute: 600 is 10 requests a second. The answers clients got
    (kubesgl_router_responses_total) and the streams broken after they started; some cases also
    feed the attempts on workers, which tell nothing of what clients got: the alert reads none."""

    def answers(instance: str, per_status: dict[str, int], broken: int = 0) -> list[dict]:
        found = [router_up(instance)]
        for status, per_minute in per_status.items():
            found.append(
                router(
                    instance,
                    "kubesgl_router_responses_total",
                    f"0+{per_minute}x30",
                    status=status,
                )
            )
        for reason, per_minute in (("worker", broken), ("shutdown", 0)):
            found.append(
                router(
                    instance,
                    "kubesgl_router_broken_streams_total",
                    f"0+{per_minute}x30",
                    reason=reason,
                )
            )
        return found

    def attempts(instance: str, url: str, role: str, per_status: dict[str, int]) -> list[dict]:
        found = worker(instance, url, role, "1x30")
        for status, per_minute in per_status.items():
            found.append(
                router(
                    instance,
                    "kubesgl_router_requests_total",
                    f"0+{per_minute}x30",
                    worker=url,
                    status=status,
                )
            )
        return found

    # The rule reads only the answers; the attempts beside them are what the workers saw, so
    # that a rule reading attempts again (retried refusals and errors as failures) fails here.
    return {
        "interval": "1m",
        "input_series": [
            # failing: 60 of 660 answers a minute are 500s (9%)
            *answers("failing", {"200": 600, "500": 60}),
            # healthy: 1%, and 4xx, which are the clients' own (a client that left got none)
            *answers("healthy", {"200": 600, "500": 6, "404": 300, "400": 300}),
            # broken: connections that break count as failures, before the answer started
            # (the client's 502) or after (a 200 stream ended by an error event): 60 of 600
            *answers("broken", {"200": 570, "502": 30}, broken=30),
            # rejected: the router's own 503s, no worker could serve (2 of 12)
            *answers("rejected", {"200": 600, "503": 120}),
            # P/D: a failing prefill worker fails 60 of 600 requests: one answer each, whatever
            # the attempts on both sides
            *answers("pd", {"200": 540, "502": 60}),
            *attempts("pd", "http://p1", "prefill", {"200": 540, "500": 30, "error": 30}),
            *attempts("pd", "http://d1", "decode", {"200": 540, "cancelled": 60}),
            # P/D, healthy
            *answers("pd-ok", {"200": 597, "500": 3}),
            *attempts("pd-ok", "http://p1", "prefill", {"200": 600}),
            *attempts("pd-ok", "http://d1", "decode", {"200": 597, "500": 3}),
            # shedding: full queues (--max-queued-requests) refuse 300 attempts a minute with
            # 503, each retried on the other worker, which serves it: every client is served
            *answers("shedding", {"200": 900}),
            *attempts("shedding", "http://w1", "mixed", {"200": 300, "503": 300}),
            *attempts("shedding", "http://w2", "mixed", {"200": 600, "503": 0}),
            # P/D shedding: prefill workers refuse, the pair is tried again (the decode
            # attempt of the refused pair counts `cancelled`)
            *answers("pd-shedding", {"200": 600}),
            *attempts("pd-shedding", "http://p1", "prefill", {"200": 600, "503": 300}),
            *attempts("pd-shedding", "http://d1", "decode", {"200": 600, "cancelled": 300}),
            # every worker full: each of 60 requests a minute refused on all four tries (the
            # first and 3 retries), the last worker's 503 passed on: 60 of 600 clients got 503
            *answers("passed-on", {"200": 540, "503": 60}),
            *attempts("passed-on", "http://w1", "mixed", {"200": 270, "503": 120}),
            *attempts("passed-on", "http://w2", "mixed", {"200": 270, "503": 120}),
            # retried: connections refused on one worker, each retried on another that served
            # it: failed attempts (10%) that no client saw
            *answers("retried", {"200": 600}),
            *attempts("retried", "http://w1", "mixed", {"200": 300, "error": 60}),
            *attempts("retried", "http://w2", "mixed", {"200": 300}),
            # shedding and failing: 60 500s in 660 answers (9%), among 1200 refusals retried
            *answers("shedding-failing", {"200": 600, "500": 60}),
            *attempts("shedding-failing", "http://w1", "mixed", {"200": 600, "503": 1200}),
            *attempts("shedding-failing", "http://w2", "mixed", {"500": 60}),
            # no free connection: the router's own 503 connection_limit, 120 of 720 answers
            *answers("limited", {"200": 600, "503": 120}),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KubesglHighServerErrorRatio", "exp_alerts": []},
            {
                "eval_time": "15m",
                "alertname": "KubesglHighServerErrorRatio",
                "exp_alerts": [
                    fires(name, "critical")
                    for name in (
                        "failing",
                        "broken",
                        "rejected",
                        "pd",
                        "passed-on",
                        "shedding-failing",
                        "limited",
                    )
                ],
            },
        ],
    }


def engine_cases() -> dict:
    def engine(pod: str, usage: str, waiting: str) -> list[dict]:
        labels = {
            "namespace": "ns",
            "app_kubernetes_io_instance": "svc",
            "kubesgl_io_role": "decode",
            "role": "decode",
            "model_name": "m",
            "pod": pod,
        }
        return [
            series("kubesgl_kv_cache_usage_ratio", usage, **labels),
            series("kubesgl_num_waiting_requests", waiting, **labels),
        ]

    full = {"role": "decode", "model_name": "m"}
    return {
        "interval": "1m",
        "input_series": [
            *engine("saturated", "0.97x30", "4x30"),
            # full, its queue emptied at every other scrape: saturated all the same
            *engine("flicker", "0.97x30", " ".join(["3", "0"] * 15)),
            *engine("busy", "0.97x30", "0x30"),  # full, and nothing waits: admission keeps up
            *engine("queued", "0.5x30", "8x30"),  # requests wait, KV to spare
            # a queue for 4 minutes from 11m: pending until 5 minutes after it, no more
            *engine("burst", "0.97x30", "0x10 3x3 0x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KubesglKVCacheFull", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "KubesglKVCacheFull",
                "exp_alerts": [
                    fires("svc", "warning", pod=pod, **full) for pod in ("saturated", "flicker")
                ],
            },
            {
                "eval_time": "25m",
                "alertname": "KubesglKVCacheFull",
                "exp_alerts": [
                    fires("svc", "warning", pod=pod, **full) for pod in ("saturated", "flicker")
                ],
            },
        ],
    }


def queue_cases() -> dict:
    """Engines that refuse requests with 503: their queues full (--max-queued-requests), or
    loading or draining. Counters per minute."""

    def engine(
        instance: str, pod: str, finished: str, refused: str, waiting: str, role: str = "mixed"
    ) -> list[dict]:
        labels = {
            "namespace": "ns",
            "app_kubernetes_io_instance": instance,
            "kubesgl_io_role": role,
            "role": role,
            "model_name": "m",
            "pod": pod,
        }
        return [
            series("kubesgl_requests_total", finished, finish_reason="stop", **labels),
            series(
                "kubesgl_request_errors_total",
                refused,
                status="503",
                reason="unavailable",
                **labels,
            ),
            series(
                "kubesgl_request_errors_total",
                "0x40",
                status="400",
                reason="invalid_request",
                **labels,
            ),
            series("kubesgl_num_waiting_requests", waiting, **labels),
        ]

    def step(at: int, by: int) -> str:
        """A counter that grows by `by` at minute `at`, over 40 minutes."""
        return " ".join(str(0 if minute < at else by) for minute in range(41))

    def during(at: int, value: int) -> str:
        """A gauge at `value` in minute `at` only."""
        return " ".join(str(value if minute == at else 0) for minute in range(41))

    return {
        "interval": "1m",
        "input_series": [
            # shedding: both pods refuse 60 a minute, finish 600, their queues full (9%)
            *engine("shedding", "a", "0+600x40", "0+60x40", "8x40"),
            *engine("shedding", "b", "0+600x40", "0+60x40", "8x40"),
            # loading: every request refused, none waiting (a static worker list's engine
            # that the router still tries, say): no queue, no shedding
            *engine("loading", "a", "0x40", "0+600x40", "0x40"),
            *engine("loading", "b", "0+600x40", "0x40", "0x40"),
            # a rollout: each of 4 pods, draining one after another 3 minutes apart, refuses
            # the 10 requests of its few seconds before the router sees it, with its queue
            # still there (under 1% of the 600 a minute the pods finish)
            *[
                pod
                for index in range(4)
                for pod in engine(
                    "rollout",
                    f"r{index}",
                    "0+150x40",
                    step(2 + 3 * index, 10),
                    during(2 + 3 * index, 3),
                )
            ],
            # a trickle: 6 refusals a minute in 606 (1%)
            *engine("trickle", "a", "0+600x40", "0+6x40", "8x40"),
            # a burst: 9% refused for 6 minutes, then none
            *engine("burst", "a", "0+600x40", "0+60x5 360x35", "8x5 0x35"),
            # P/D: the prefill engines shed (they finish as handoff), the decode ones do not
            *engine("pd", "p", "0+600x40", "0+60x40", "8x40", role="prefill"),
            *engine("pd", "d", "0+600x40", "0x40", "2x40", role="decode"),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KubesglEngineQueueFull", "exp_alerts": []},
            {  # the rollout's drains, 3 minutes apart, are over at 17m
                "eval_time": "15m",
                "alertname": "KubesglEngineQueueFull",
                "exp_alerts": [
                    fires("shedding", "warning", role="mixed"),
                    fires("pd", "warning", role="prefill"),
                ],
            },
            {
                "eval_time": "20m",
                "alertname": "KubesglEngineQueueFull",
                "exp_alerts": [
                    fires("shedding", "warning", role="mixed"),
                    fires("pd", "warning", role="prefill"),
                ],
            },
            {
                "eval_time": "35m",
                "alertname": "KubesglEngineQueueFull",
                "exp_alerts": [
                    fires("shedding", "warning", role="mixed"),
                    fires("pd", "warning", role="prefill"),
                ],
            },
        ],
    }


def pd_cases() -> dict:
    def engine(instance: str, metric: str, values: str, **labels: str) -> dict:
        role = labels.pop("role", "decode")
        return series(
            metric,
            values,
            namespace="ns",
            app_kubernetes_io_instance=instance,
            kubesgl_io_role=role,
            role=role,
            model_name="m",
            pod=f"{instance}-{role}-0",
            **labels,
        )

    failures = "kubesgl_disagg_failures_total"
    return {
        "interval": "1m",
        "input_series": [
            # a transport that keeps failing, on both engines (each counts its rooms)
            engine("broken", failures, "0+2x30", reason="transfer"),
            engine("broken", failures, "0+2x30", reason="transfer", role="prefill"),
            # clients that leave and requests one engine refuses: no transfer's fault
            engine("clients", failures, "0+5x30", reason="aborted"),
            engine("clients", failures, "0+5x30", reason="refused"),
            # a partner lost once, in a rollout: a few minutes of rate, then none
            engine("rollout", failures, "0x5 3x30", reason="peer_lost"),
            # retractions: 60 a minute over 60 finished requests (storm), 6 over 60 (fine),
            # and 60 on an engine that finishes nothing
            engine("storm", "kubesgl_retractions_total", "0+60x30"),
            engine("storm", "kubesgl_requests_total", "0+60x30", finish_reason="stop"),
            engine("calm", "kubesgl_retractions_total", "0+6x30"),
            engine("calm", "kubesgl_requests_total", "0+60x30", finish_reason="stop"),
            engine("stuck", "kubesgl_retractions_total", "0+60x30"),
            engine("stuck", "kubesgl_requests_total", "0x30", finish_reason="stop"),
        ],
        "alert_rule_test": [
            {"eval_time": "14m", "alertname": "KubesglKVTransferFailures", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "KubesglKVTransferFailures",
                "exp_alerts": [
                    fires("broken", "warning", role=role, reason="transfer")
                    for role in ("decode", "prefill")
                ],
            },
            {"eval_time": "14m", "alertname": "KubesglRetractionStorm", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "KubesglRetractionStorm",
                "exp_alerts": [
                    fires(name, "warning", role="decode", model_name="m", pod=f"{name}-decode-0")
                    for name in ("storm", "stuck")
                ],
            },
        ],
    }


@needs_promtool
def test_alerts_fire_when_they_should_and_not_otherwise(tmp_path: Path):
    # annotations left out: promtool compares them too, and `promtool check rules` above checks
    # their templates; these cases are about the expressions and their `for`
    document = yaml.safe_load(RULES.read_text())
    for rule in document["groups"][0]["rules"]:
        del rule["annotations"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(document))
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [worker_cases(), error_cases(), engine_cases(), queue_cases(), pd_cases()],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
