"""`kubesgl up`'s supervisor with small stand-in processes (an HTTP server with a child process,
as an engine has its scheduler): restarts with a doubling delay and the reason, the start order,
and a stop that drains the router first and leaves no process behind, a hung one included."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kubesgl import contract
from kubesgl.up.plan import LocalProcess
from kubesgl.up.supervisor import Health, State, Supervisor, all_ready, exit_reason

STAND_IN = r"""
import http.server, signal, subprocess, sys
port, behaviour = int(sys.argv[1]), sys.argv[2]
if behaviour == "crash":
    print("loading the model", flush=True)
    print("RuntimeError: no memory left for the KV cache", flush=True)
    sys.exit(3)
if behaviour == "usage":  # what kubesgl serve does with an option the model cannot take
    print("kubesgl serve: --context-length 100000 exceeds the model's 2048", flush=True)
    sys.exit(2)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # same process group
signal.signal(signal.SIGUSR1, lambda *_: print("SIGUSR1", flush=True))  # what a router does, noted
print(f"child {child.pid}", flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN if behaviour == "hang" else lambda *_: sys.exit(0))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError:  # kubesgl serve's preflight: a port in use is a StartupError, status 2
    print(f"kubesgl serve: port {port} on 127.0.0.1 is in use", flush=True)
    sys.exit(2)
server.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def make(
        name: str,
        behaviour: str,
        role: contract.PodRole = contract.MIXED,
        stop_timeout_s: float = 10,
        waits_for: tuple[contract.EngineRole, ...] = (),
    ) -> LocalProcess:
        port = free_port()
        return LocalProcess(
            name,
            role,
            (sys.executable, str(script), str(port), behaviour),
            {},
            port,
            stop_timeout_s,
            waits_for=waits_for,
        )

    return make


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


def children(replica) -> list[int]:
    """The stand-in's child, once it has written its pid."""
    return [int(pid) for pid in re.findall(r"^child (\d+)$", replica.log_path.read_text(), re.M)]


def test_a_replica_that_dies_is_restarted_at_once_then_with_a_doubling_delay_and_its_reason(
    stand_in, tmp_path
):
    clock, events = FakeClock(), []
    supervisor = Supervisor(
        [stand_in("mixed-0", "crash")], tmp_path, lambda r, m: events.append(m), clock=clock
    )
    (replica,) = supervisor.replicas
    reason = "exit code 3: RuntimeError: no memory left for the KV cache"
    supervisor.tick()
    replica.popen.wait()
    supervisor.tick()  # a first exit (a kill, an OOM) is no crash loop yet: started in the same tick
    assert events[-2:] == [f"exited ({reason}); restarting now", f"started, pid {replica.pid}"]
    assert replica.state == State.STARTING and replica.restarts == 1
    for delay in (1, 2, 4):
        replica.popen.wait()
        supervisor.tick()
        assert replica.state == State.BACKOFF and replica.popen is None
        assert events[-1] == f"exited ({reason}); restarting in {delay} s"
        clock.now += delay - 0.01
        supervisor.tick()
        assert replica.state == State.BACKOFF  # not before its time
        clock.now += 0.01
        supervisor.tick()
        assert replica.state == State.STARTING
    assert replica.restarts == 4
    replica.popen.wait()
    clock.now += 300  # it ran long enough this time: the delay starts over
    supervisor.tick()
    assert events[-2].endswith("restarting now") and replica.state == State.STARTING
    assert "restart 5: " in replica.log_path.read_text()  # each start is marked in the log


def test_a_replica_that_cannot_be_started_is_backed_off_with_the_reason(tmp_path):
    """Popen's OSError (no such program, too many open files) escaped the supervisor: `kubesgl
    up` ended in a traceback."""
    clock, events = FakeClock(), []
    process = LocalProcess("mixed-0", contract.MIXED, (str(tmp_path / "gone"),), {}, 1, 10)
    supervisor = Supervisor([process], tmp_path, lambda r, m: events.append(m), clock=clock)
    (replica,) = supervisor.replicas
    supervisor.tick()
    reason = f"could not start: [Errno 2] No such file or directory: '{tmp_path / 'gone'}'"
    assert (replica.state, replica.last_exit, events) == (
        State.BACKOFF,
        reason,
        [f"{reason}; restarting now"],
    )
    assert replica.log_path.read_text().endswith(reason + "\n")
    supervisor.tick()  # due at once, the first time; then the crash loop's delay
    assert events[-1] == f"{reason}; restarting in 1 s" and replica.restarts == 1
    supervisor.close()


def test_a_replica_that_exits_with_status_2_is_failed_not_restarted(stand_in, tmp_path):
    """Status 2 is a usage or configuration error found before the process serves: every
    restart repeated it, with a growing delay, and the service never turned ready."""
    clock, events = FakeClock(), []
    supervisor = Supervisor(
        [stand_in("prefill-0", "usage", contract.PREFILL), stand_in("decode-0", "ok")],
        tmp_path,
        lambda r, m: events.append(f"{r.process.name}: {m}"),
        clock=clock,
    )
    failing, other = supervisor.replicas
    supervisor.tick()
    failing.popen.wait()
    supervisor.tick()
    reason = "exit code 2: kubesgl serve: --context-length 100000 exceeds the model's 2048"
    assert failing.state == State.FAILED and failing.popen is None
    assert not failing.has_been_ready  # its first start, before /health answered
    assert failing.last_exit == reason and supervisor.failed == [failing]
    assert "prefill-0: exited with status 2, a configuration error: not restarting" in events
    clock.now += 300
    supervisor.tick()
    assert failing.state == State.FAILED and failing.restarts == 0
    assert other.popen is not None and other.popen.poll() is None  # stopping it is up's part
    supervisor.stop(threading.Event())
    assert failing.state == State.FAILED and other.state == State.STOPPED
    assert supervisor.failed == [failing]


def test_status_2_from_a_replica_that_was_ready_is_restarted_with_backoff(stand_in, tmp_path):
    """A replica that has served and died is restarted at once, maybe while its old port is
    still held (by a process it left behind, or the kernel): kubesgl serve then exits 2 (a
    StartupError), which is no configuration error here, since the same flags served before.
    It backs off and recovers; before, it failed and stopped everything."""
    clock, events = FakeClock(), []
    supervisor = Supervisor(
        [stand_in("mixed-0", "ok")],
        tmp_path,
        lambda r, m: events.append(m),
        healthy=lambda url: Health(True),
        clock=clock,
    )
    (replica,) = supervisor.replicas
    supervisor.tick()
    supervisor.tick()
    assert replica.state == State.READY and replica.has_been_ready
    replica.popen.send_signal(signal.SIGKILL)
    replica.popen.wait()
    with socket.socket() as holder:  # the old port, still held when it restarts at once
        holder.bind(("127.0.0.1", replica.process.port))
        holder.listen()
        supervisor.tick()
        assert events[-2] == "exited (killed by SIGKILL); restarting now"
        assert replica.state == State.STARTING
        replica.popen.wait()
        supervisor.tick()
        port = replica.process.port
        reason = f"exit code 2: kubesgl serve: port {port} on 127.0.0.1 is in use"
        assert events[-1] == f"exited ({reason}); restarting in 1 s"
        assert replica.state == State.BACKOFF and supervisor.failed == []
    clock.now += 1
    supervisor.tick()  # the port is free now: it starts, and serves again
    assert replica.state == State.STARTING and replica.restarts == 2
    supervisor.tick()
    assert replica.state == State.READY
    supervisor.stop(threading.Event())
    assert replica.state == State.STOPPED


def test_the_router_starts_once_every_role_has_a_ready_replica(stand_in, tmp_path):
    ready: set[str] = set()
    prefill, decode = (
        stand_in("prefill-0", "ok", contract.PREFILL),
        stand_in("decode-0", "ok", contract.DECODE),
    )
    router = stand_in(
        "router", "ok", contract.ROUTER, waits_for=(contract.PREFILL, contract.DECODE)
    )
    prefill = dataclasses.replace(prefill, bootstrap_port=free_port())
    events: list[str] = []
    supervisor = Supervisor(
        [prefill, decode, router],
        tmp_path,
        on_event=lambda replica, message: events.append(f"{replica.process.name}: {message}"),
        healthy=lambda url: Health(url in ready, "503: not ready"),
    )
    try:
        supervisor.tick()
        assert [r.state for r in supervisor.replicas] == [
            State.STARTING,
            State.STARTING,
            State.WAITING,
        ]
        ready.add(prefill.url)
        supervisor.tick()
        assert [r.state for r in supervisor.replicas] == [
            State.READY,
            State.STARTING,
            State.WAITING,
        ]
        ready.add(decode.url)
        supervisor.tick()
        supervisor.tick()
        assert [r.state for r in supervisor.replicas] == [State.READY, State.READY, State.STARTING]
        # P/D errors name a prefill engine by its bootstrap address
        assert (
            f"prefill-0: ready on {prefill.url} (bootstrap port {prefill.bootstrap_port})" in events
        )
        assert f"decode-0: ready on {decode.url}" in events
        ready.discard(prefill.url)
        supervisor.tick()
        assert events[-1] == "prefill-0: not ready: /health fails (503: not ready)"
    finally:
        supervisor.stop(threading.Event())


def test_the_router_hears_at_once_of_an_engine_that_turns_ready(stand_in, tmp_path):
    """It checks the workers out of its pool then (SIGUSR1), not at its next health check, up
    to 5 s later: a killed engine's requests failed for that long after it was back. A router
    that has not answered /health yet hears nothing: the signal's default would end it."""
    supervisor = Supervisor(
        [
            stand_in("decode-0", "ok", contract.DECODE),
            stand_in("router", "ok", contract.ROUTER, waits_for=(contract.DECODE,)),
        ],
        tmp_path,
    )
    engine, router = supervisor.replicas
    try:
        wait_for(lambda: supervisor.tick() or all_ready(supervisor.replicas))
        killed = engine.pid
        os.killpg(killed, signal.SIGKILL)
        wait_for(lambda: supervisor.tick() or (engine.pid != killed and all_ready([engine])))
        wait_for(lambda: "SIGUSR1" in router.log_path.read_text())
        time.sleep(0.2)
        assert router.log_path.read_text().count("SIGUSR1") == 1  # none when it started
        assert router.state == State.READY and router.restarts == 0
    finally:
        supervisor.stop(threading.Event())


def test_stop_drains_the_router_first_and_leaves_nothing_behind_a_hung_replica_included(
    stand_in, tmp_path
):
    events: list[str] = []
    processes = [
        stand_in("mixed-0", "hang", stop_timeout_s=0.5),
        stand_in("mixed-1", "ok"),
        stand_in("router", "ok", contract.ROUTER),
    ]
    supervisor = Supervisor(
        processes, tmp_path, lambda r, m: events.append(f"{r.process.name}: {m}")
    )
    wait_for(lambda: supervisor.tick() or all_ready(supervisor.replicas))
    pids = [r.pid for r in supervisor.replicas]
    pids += [pid for r in supervisor.replicas for pid in wait_for(lambda r=r: children(r))]
    started = time.monotonic()
    # where `kubesgl up` closes the router's port: once no router starts again
    supervisor.stop(threading.Event(), routers_stopping=lambda: events.append("routers stopping"))
    assert time.monotonic() - started < 5
    stops = [e for e in events if "stopped" in e or "killed" in e or "stopping" in e]
    assert stops[:2] == ["routers stopping", "router: stopped"]  # before any engine's stop
    assert sorted(stops[2:]) == [
        "mixed-0: killed: it did not stop within 0.5 s",
        "mixed-1: stopped",
    ]
    assert [pid for pid in pids if running(pid)] == []  # the children too: they were in the groups
    assert all(r.state == State.STOPPED and r.popen is None for r in supervisor.replicas)


def test_a_second_signal_kills_at_once(stand_in, tmp_path):
    events: list[str] = []
    supervisor = Supervisor(
        [stand_in("mixed-0", "hang", stop_timeout_s=120)], tmp_path, lambda r, m: events.append(m)
    )
    wait_for(lambda: supervisor.tick() or all_ready(supervisor.replicas))
    child = wait_for(lambda: children(supervisor.replicas[0]))[0]
    force = threading.Event()
    threading.Timer(0.3, force.set).start()
    started = time.monotonic()
    supervisor.stop(force)
    assert time.monotonic() - started < 5
    assert events[-1] == "killed: at once, as asked" and not running(child)


SUPERVISING = r"""
import sys, time
from kubesgl.up.plan import LocalProcess
from kubesgl.up.supervisor import Supervisor, all_ready
from kubesgl import contract
from pathlib import Path
port, log_dir, argv = int(sys.argv[1]), sys.argv[2], tuple(sys.argv[3:])
process = LocalProcess("mixed-0", contract.MIXED, argv, {}, port, 10)
supervisor = Supervisor([process], Path(log_dir))
while not all_ready(supervisor.replicas):
    supervisor.tick()
    time.sleep(0.05)
print(supervisor.replicas[0].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(
    sys.platform != "linux",
    reason="PR_SET_PDEATHSIG is a Linux prctl: elsewhere kubesgl up does not set it",
)
def test_replicas_drain_when_the_supervisor_is_killed(stand_in, tmp_path):
    """`kubesgl up` killed outright (SIGKILL, or a crash) cannot stop its replicas: each gets
    SIGTERM from the kernel instead, and none is left serving without it."""
    replica = stand_in("mixed-0", "ok")
    script = tmp_path / "supervising.py"
    script.write_text(SUPERVISING)
    supervising = subprocess.Popen(
        [sys.executable, str(script), str(replica.port), str(tmp_path), *replica.argv],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert supervising.stdout is not None
    pid = int(supervising.stdout.readline())
    try:
        assert running(pid)
        supervising.kill()
        supervising.wait()
        wait_for(lambda: not running(pid), timeout=10)
    finally:
        supervising.kill()
        supervising.wait()
        supervising.stdout.close()
        # the stand-in exits on SIGTERM but leaves its child, whose group outlives its leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_health_probes_share_one_client(monkeypatch):
    """A client per probe built its TLS context each time (29 ms of CPU, six probes a second
    for the quickstart): the supervisor alone kept a sixth of a core busy."""

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    made = []
    real_init = httpx.Client.__init__

    def counting_init(self, *args, **kwargs):
        made.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counting_init)
    try:
        healthy = Supervisor([], Path("/nonexistent")).healthy
        url = f"http://127.0.0.1:{server.server_port}"
        assert [healthy(url) for _ in range(5)] == [Health(True)] * 5
        assert not healthy(f"http://127.0.0.1:{free_port()}").ok  # nothing listens: not healthy
        assert len(made) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_probe_says_why():
    """`kubesgl up` printed `router: not ready: /health fails` while only the prefill engine was
    down; the router's 503 names the role it lacks, and the probe passes that on."""
    message = "no prefill worker can serve: 1 registered, 1 failing health checks"

    class Unready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (
                b'{"error": {"message": "%s", "type": "service_unavailable"}}' % message.encode()
                if self.path == "/health"
                else b"not ready\nat all"
            )
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Unready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        healthy = Supervisor([], Path("/nonexistent")).healthy
        assert healthy(f"http://127.0.0.1:{server.server_port}") == Health(False, f"503: {message}")
        assert healthy(f"http://127.0.0.1:{server.server_port}/plain") == Health(
            False, "503: not ready"
        )
        refused = healthy(f"http://127.0.0.1:{free_port()}")
        assert not refused.ok and refused.why.startswith("ConnectError: ")
    finally:
        server.shutdown()


def test_the_reason_of_an_exit_is_the_logs_last_line_whole(tmp_path):
    """An engine's start-up error is one line with what to do last; it was cut at 160
    characters ("... give at most 2048, or leave it un"). A line that runs on is cut with a
    mark."""
    log = tmp_path / "prefill-0.log"
    error = (
        "kubesgl serve: --context-length 100000 exceeds this model's context length, 2048 "
        "(max_position_embeddings in its config.json); give at most 2048, or leave it unset"
    )
    log.write_text(f"loading\n{error}\n\n")
    assert exit_reason(2, log) == f"exit code 2: {error}"
    log.write_text("x" * 3000 + "\n")
    reason = exit_reason(1, log)
    assert reason.startswith("exit code 1: xxx") and reason.endswith("…") and len(reason) < 500


def test_a_process_killed_by_a_signal_without_a_name_has_a_reason(tmp_path):
    """signal.Signals has no member for real-time signals (SIGRTMIN+n): signal 40 raised
    ValueError out of the supervisor's tick and took the whole `kubesgl up` down."""
    log = tmp_path / "mixed-0.log"
    assert exit_reason(-signal.SIGKILL, log) == "killed by SIGKILL"
    assert exit_reason(-(signal.SIGRTMIN + 6), log) == f"killed by signal {signal.SIGRTMIN + 6}"


def test_replicas_that_never_answer_are_probed_together_not_one_after_another(
    tmp_path, monkeypatch
):
    """Probed in turn, each hung replica cost its probe's whole timeout: with four, a tick
    took four, and so did noticing a death, a restart or the first Ctrl-C."""
    timeout_s = 0.5
    monkeypatch.setattr("kubesgl.up.supervisor.HEALTH_TIMEOUT_S", timeout_s)
    hung = socket.socket()  # connections are taken (the backlog) and never answered
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    port = hung.getsockname()[1]
    sleeper = (sys.executable, "-c", "import time; time.sleep(600)")
    processes = [LocalProcess(f"mixed-{i}", contract.MIXED, sleeper, {}, port, 5) for i in range(4)]
    with Supervisor(processes, tmp_path) as supervisor:
        try:
            supervisor.tick()  # starts them
            started = time.monotonic()
            supervisor.tick()  # probes them
            took = time.monotonic() - started
            assert [replica.state for replica in supervisor.replicas] == [State.STARTING] * 4
            assert took < 2 * timeout_s
        finally:
            supervisor.stop(threading.Event())
            hung.close()


def test_the_supervisor_closes_its_health_client_when_it_ends(tmp_path):
    with Supervisor([], tmp_path) as supervisor:
        client = supervisor.healthy._client  # type: ignore[attr-defined]
    assert client.is_closed
