"""What `kubesgl up` shows: the counters read from the engines' and the router's /metrics, the
table with tokens/s and the reason of the last exit, redrawn in place on a terminal; events as
lines elsewhere."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from kubesgl import contract
from kubesgl.up.plan import LocalPlan, LocalProcess
from kubesgl.up.status import Counters, StatusView, format_table, read_counters
from kubesgl.up.supervisor import Replica, State

ENGINE_METRICS = """\
# TYPE kubesgl_num_running_requests gauge
kubesgl_num_running_requests{role="decode"} 2.0
# TYPE kubesgl_generation_tokens counter
kubesgl_generation_tokens_total{role="decode"} 340.0
# TYPE kubesgl_requests counter
kubesgl_requests_total{finish_reason="length",role="decode"} 3.0
kubesgl_requests_total{finish_reason="stop",role="decode"} 4.0
"""
ROUTER_METRICS = """\
# TYPE kubesgl_router_requests counter
kubesgl_router_requests_total{status="200",worker="http://127.0.0.1:1"} 5.0
kubesgl_router_requests_total{status="200",worker="http://127.0.0.1:2"} 5.0
# TYPE kubesgl_router_request_duration_seconds histogram
kubesgl_router_request_duration_seconds_bucket{le="+Inf"} 5.0
kubesgl_router_request_duration_seconds_count 5.0
kubesgl_router_request_duration_seconds_sum 2.5
"""


def process(
    name: str, role: contract.PodRole, port: int, bootstrap: int | None = None
) -> LocalProcess:
    return LocalProcess(name, role, ("kubesgl",), {}, port, 10, bootstrap)


def test_counters_from_the_metrics_of_engines_and_router():
    pages = {"http://e/metrics": ENGINE_METRICS, "http://r/metrics": ROUTER_METRICS}
    client = httpx.Client(
        transport=httpx.MockTransport(
            lambda request: httpx.Response(200, text=pages[str(request.url)])
        )
    )
    engine = read_counters(client, "http://e", contract.DECODE)
    assert engine is not None and (engine.requests, engine.running, engine.tokens) == (7, 2, 340)
    router = read_counters(client, "http://r", contract.ROUTER)
    assert router is not None and router.requests == 5  # client requests, not upstream attempts
    assert (
        read_counters(
            httpx.Client(transport=httpx.MockTransport(refuse)), "http://e", contract.DECODE
        )
        is None
    )


@pytest.mark.parametrize(
    "answer",
    [httpx.Response(500, text="Internal Server Error"), httpx.Response(200, text="<html>")],
    ids=["500", "not-prometheus"],
)
def test_a_metrics_page_that_cannot_be_read_gives_no_counters(answer):
    """A 500 or a page in another format raised out of the table's refresh: `kubesgl up`
    stopped everything with a traceback."""
    client = httpx.Client(transport=httpx.MockTransport(lambda request: answer))
    assert read_counters(client, "http://e", contract.DECODE) is None


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_the_table_shows_states_ports_devices_rates_and_the_last_exit(tmp_path):
    prefill = Replica(
        process("prefill-0", contract.PREFILL, 30001, bootstrap=30002),
        tmp_path / "p.log",
        State.READY,
    )
    decode = Replica(
        process("decode-0", contract.DECODE, 30003),
        tmp_path / "d.log",
        State.STARTING,
        restarts=1,
        last_exit="killed by SIGKILL",
    )
    counters = {"prefill-0": (Counters(1, 0, 100, at=10.0), Counters(3, 1, 160, at=12.0))}
    lines = format_table([prefill, decode], counters)
    assert lines[0].split() == [
        "NAME",
        "STATE",
        "PID",
        "PORT",
        "BOOT",
        "DEVICE",
        "RESTARTS",
        "REQS",
        "RUNNING",
        "TOK/S",
    ]
    assert lines[1].split() == [
        "prefill-0",
        "ready",
        "-",
        "30001",
        "30002",
        "cpu",
        "0",
        "3",
        "1",
        "30.0",
    ]
    assert lines[2].split() == [
        "decode-0",
        "starting",
        "-",
        "30003",
        "-",
        "cpu",
        "1",
        "-",
        "-",
        "-",
    ]
    assert max(map(len, lines[:3])) <= 80  # a terminal's width
    assert lines[3] == "decode-0 last exited: killed by SIGKILL"


def test_a_stopped_replica_shows_no_rates_from_before_it_stopped(tmp_path):
    """The last frame, drawn after Ctrl-C, showed each engine's requests running and tokens/s
    of its last scrape, as if it still served; the requests it served stay shown."""
    stopped = Replica(
        process("decode-0", contract.DECODE, 30003), tmp_path / "d.log", State.STOPPED
    )
    counters = {"decode-0": (Counters(1, 0, 100, at=10.0), Counters(3, 2, 160, at=12.0))}
    assert format_table([stopped], counters)[1].split()[-3:] == ["3", "-", "-"]


def test_replicas_that_exited_alike_share_one_line_below_the_table(tmp_path):
    """Every replica refusing the spec says the same: one line each repeated it."""
    why = "exit code 2: kubesgl serve: --context-length 100000 exceeds the model's 2048"
    replicas = [
        Replica(process(name, contract.DECODE, port), tmp_path / f"{name}.log", last_exit=why)
        for name, port in (("decode-0", 30001), ("decode-1", 30002))
    ]
    assert format_table(replicas, {})[3:] == [f"decode-0, decode-1 last exited: {why}"]


def local_plan() -> LocalPlan:
    return LocalPlan(
        "demo",
        "mixed",
        "/models/tiny",
        None,
        (process("mixed-0", contract.MIXED, 30001),),
        process("router", contract.ROUTER, 8000),
        (),
    )


def test_on_a_terminal_the_view_is_redrawn_in_place(tmp_path):
    out = io.StringIO()
    view = StatusView(local_plan(), Path("/logs"), out, live=True)
    replicas = [Replica(p, tmp_path / "x.log", State.STARTING) for p in local_plan().processes]
    view.refresh(replicas)
    first = out.getvalue()
    assert first.startswith("kubesgl up: demo (mixed)   Ctrl-C stops everything\nOpenAI base URL: ")
    assert "OpenAI base URL: http://127.0.0.1:8000/v1" in first and "\x1b[" not in first
    view.refresh(replicas)
    assert out.getvalue()[len(first) :].startswith(
        f"\x1b[{first.count(chr(10))}F\x1b[J"
    )  # back up, clear, redraw
    view.close()


def test_elsewhere_events_are_lines(tmp_path):
    out = io.StringIO()
    view = StatusView(local_plan(), Path("/logs"), out, live=False)
    replicas = [Replica(p, tmp_path / "x.log", State.READY) for p in local_plan().processes]
    view.event(replicas[0], "ready on http://127.0.0.1:30001")
    view.refresh(replicas)
    view.refresh(replicas)
    lines = out.getvalue().splitlines()
    assert lines[1:4] == [
        "OpenAI base URL: http://127.0.0.1:8000/v1",
        "model: /models/tiny",
        "logs: /logs",
    ]
    assert lines[4].endswith(" mixed-0: ready on http://127.0.0.1:30001")
    assert "ready in " in lines[5] and lines[5].endswith("OpenAI base URL http://127.0.0.1:8000/v1")
    assert len(lines) == 6  # said once
    view.close()


def test_a_metrics_page_that_hangs_holds_up_no_refresh(tmp_path):
    """The scrapes ran in the supervisor's tick, one after another, up to 1 s each: replicas
    whose /metrics hung delayed noticing deaths and restarting by as many seconds."""
    release = threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        release.wait(5)
        return httpx.Response(200, text=ENGINE_METRICS)

    view = StatusView(local_plan(), Path("/logs"), io.StringIO(), live=True)
    view._client = httpx.Client(transport=httpx.MockTransport(slow))
    replicas = [Replica(p, tmp_path / "x.log", State.READY) for p in local_plan().processes]
    started = time.monotonic()
    view.refresh(replicas)
    view._scraped_at = 0.0  # a scrape is due again: its round still reads
    view.refresh(replicas)
    assert time.monotonic() - started < 0.5
    release.set()
    view._round.result(timeout=5)
    view._scraped_at = 0.0
    view.refresh(replicas)  # takes in the round that ended
    assert format_table(replicas, view._counters)[1].split()[-3:-1] == ["7", "2"]  # REQS, RUNNING
    view.close()


def test_an_event_longer_than_the_terminal_is_wrapped_not_cut(tmp_path, monkeypatch):
    """The stop line lost its end at 80 columns ("(Ctrl-C again kills them at once")."""
    monkeypatch.setattr("shutil.get_terminal_size", lambda: os.terminal_size((40, 24)))
    out = io.StringIO()
    view = StatusView(local_plan(), Path("/logs"), out, live=True)
    view.note("stopping: the router, then the engines (Ctrl-C again kills them at once)")
    view.refresh([Replica(p, tmp_path / "x.log", State.STOPPING) for p in local_plan().processes])
    drawn = out.getvalue().splitlines()
    assert all(len(line) <= 40 for line in drawn)
    assert " ".join(line.strip() for line in drawn[-3:]).endswith("kills them at once)")
    view.close()


def test_a_restarted_replica_shows_no_rate_against_its_old_process(tmp_path):
    """Its first TOK/S after a restart compared the new process's counts with the dead one's:
    a large negative rate."""
    replica = Replica(process("mixed-0", contract.MIXED, 30001), tmp_path / "x.log", State.READY)
    before, after = Counters(9, 1, 340, at=10.0, pid=100), Counters(1, 1, 5, at=11.0, pid=200)
    assert format_table([replica], {"mixed-0": (before, after)})[1].split()[-3:] == ["1", "1", "-"]
    same = Counters(12, 1, 400, at=11.0, pid=100)
    assert format_table([replica], {"mixed-0": (before, same)})[1].split()[-1] == "60.0"
