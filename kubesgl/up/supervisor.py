"""Runs a plan's processes as Deployments run pods: a replica that dies is started again, at once
the first time and then after a delay that doubles with each death in a row (Kubernetes'
CrashLoopBackOff, on a shorter scale), and the reason is reported. A replica that exits with
status 2 from its first start, a usage or configuration error that every start would repeat,
is not restarted: it is failed, and `kubesgl up` stops everything. A later status 2 (after a
restart, or from one that has served) is backed off as any other death: it is a startup error
that may pass, e.g. its port still held when it restarts at once. A process that cannot be
started at all (too many open files, say) is backed off the same way. `stop` drains everything, the router first, and
leaves no process behind, also when one hangs.

Each process leads a process group of its own: the engines' scheduler and tokenizer processes
are in it, and the terminal's Ctrl-C reaches `kubesgl up` alone, which stops them in order.
On Linux each also gets SIGTERM (its drain) when `kubesgl up` dies without stopping them
(SIGKILL, a crash), so that none outlives it holding its port.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import httpx

from kubesgl import contract
from kubesgl.up.log_tail import clip, last_lines
from kubesgl.up.plan import LocalProcess

BACKOFF_FIRST_S = 1.0  # after the second death in a row; the first restarts at once
BACKOFF_MAX_S = 60.0
# A replica that ran this long before it died starts its backoff over (the kubelet: 10 minutes).
BACKOFF_RESET_S = 120.0
HEALTH_TIMEOUT_S = 1.0
# How long the processes of a group may take to be gone after SIGKILL.
KILL_WAIT_S = 5.0
# The exit status of a usage or configuration error, found before the process serves (kubesgl
# serve, kubesgl router, argparse): a restart of a replica never ready would only repeat it.
CONFIGURATION_ERROR_EXIT = 2
CHECK_SIGNAL = signal.Signals[contract.ROUTER_CHECK_SIGNAL]
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
# loaded here, not between fork and exec, where the child may only make the system call
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


class State(StrEnum):
    WAITING = "waiting"  # for a ready replica of each role it waits for
    STARTING = "starting"  # running, /health not answered yet
    READY = "ready"
    UNREADY = "unready"  # was ready, /health fails now
    BACKOFF = "backoff"  # died; starts again at restart_at
    FAILED = "failed"  # status 2 before ever ready, a configuration error: never started again
    STOPPING = "stopping"
    STOPPED = "stopped"


# The states whose replicas a tick probes: running, whether ready or not.
PROBED = frozenset({State.STARTING, State.READY, State.UNREADY})


@dataclass(eq=False)
class Replica:
    process: LocalProcess
    log_path: Path
    state: State = State.WAITING
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    last_exit: str | None = None  # why it died the last time
    started_at: float = 0.0
    restart_at: float = 0.0
    deaths_in_a_row: int = 0
    # /health has answered once: a later status 2 is no configuration error, as the same flags
    # served (its port still held by what its last run left behind, for example)
    has_been_ready: bool = False
    killed: bool = False  # it did not stop on SIGTERM in time, or a second Ctrl-C killed it

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None


@dataclass(frozen=True)
class Health:
    ok: bool
    why: str = ""  # when not ok: the status and the error it names, or the connection's failure


class HttpHealth:
    """GET /health, one client for every probe: a client per probe builds its TLS context
    again, about 29 ms of CPU each time, several times a second. No keep-alive: a server
    closing an idle connection just as a probe reused it would read as a failed probe."""

    def __init__(self) -> None:
        self._client = httpx.Client(
            timeout=HEALTH_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0)
        )

    def close(self) -> None:
        self._client.close()

    def __call__(self, url: str) -> Health:  # called from several threads at once: httpx allows it
        try:
            answer = self._client.get(url + "/health")
        except httpx.HTTPError as exc:
            return Health(False, f"{type(exc).__name__}: {exc}")
        if answer.status_code == 200:
            return Health(True)
        return Health(False, f"{answer.status_code}: {_error_message(answer)}")


def _error_message(answer: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body (the router names the role it lacks and
    why), else the body's first line."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text.strip().split("\n", 1)[0][:200]


def all_ready(replicas: Sequence[Replica]) -> bool:
    return bool(replicas) and all(replica.state == State.READY for replica in replicas)


class Supervisor:
    def __init__(
        self,
        processes: Sequence[LocalProcess],
        log_dir: Path,
        on_event: Callable[[Replica, str], None] = lambda replica, message: None,
        healthy: Callable[[str], Health] | None = None,  # HttpHealth()
        clock: Callable[[], float] = time.monotonic,
    ):
        self.replicas = [Replica(p, log_dir / f"{p.name}.log") for p in processes]
        self.on_event = on_event
        self._own_health: HttpHealth | None = None  # closed by `close`
        if healthy is None:
            healthy = self._own_health = HttpHealth()
        self.healthy = healthy
        self.clock = clock
        # Every replica probed at once: in turn, each hung one held the tick for its timeout.
        self._probes = ThreadPoolExecutor(max(1, len(self.replicas)), "kubesgl-up-probe")

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the probes' threads and client (not the replicas: `stop` does)."""
        self._probes.shutdown(wait=True)
        if self._own_health is not None:
            self._own_health.close()

    @property
    def failed(self) -> list[Replica]:
        """The replicas that exited with a configuration error (status 2 before ever ready)."""
        return [replica for replica in self.replicas if replica.state == State.FAILED]

    @property
    def troubled(self) -> list[Replica]:
        """The replicas whose logs tell of trouble: each that exited on its own (a crash, a kill
        from outside, a configuration error), or had to be killed as it stopped."""
        return [replica for replica in self.replicas if replica.last_exit or replica.killed]

    def tick(self) -> None:
        """Notices deaths, starts what is due and takes in the health of what runs. The probes
        run first, together; their answers are taken in replica order, so that one turning
        ready lets those waiting for its role start in the same tick."""
        probed = [replica for replica in self.replicas if replica.state in PROBED]
        urls = [replica.process.url for replica in probed]
        health = dict(zip(probed, self._probes.map(self.healthy, urls)))
        for replica in self.replicas:
            if replica.popen is not None and replica.popen.poll() is not None:
                self._died(replica)  # its probe's answer, if any, is dropped
            due = replica.state == State.BACKOFF and self.clock() >= replica.restart_at
            if due or (replica.state == State.WAITING and self._may_start(replica)):
                self._start(replica)
            elif replica.state in PROBED and replica in health:  # running then and since
                self._take_health(replica, health[replica])

    def stop(
        self,
        force: threading.Event,
        on_tick: Callable[[], None] = lambda: None,
        routers_stopping: Callable[[], None] = lambda: None,
    ) -> None:
        """The router first, so that no new request reaches an engine, then the engines. Each
        gets SIGTERM (its drain) and, after its pod's grace period or at once when `force` is
        set, SIGKILL for its whole process group. `routers_stopping` is called once the
        routers have their SIGTERM, from when none starts again (`kubesgl up` closes its
        listening socket on the router's port there)."""
        routers = [r for r in self.replicas if r.process.role == contract.ROUTER]
        deadlines = self._terminate(routers)
        routers_stopping()
        self._wait(deadlines, force, on_tick)
        self._wait(self._terminate([r for r in self.replicas if r not in routers]), force, on_tick)

    def _terminate(self, group: list[Replica]) -> dict[Replica, float]:
        """SIGTERM to each running replica of the group; when each must have stopped by."""
        deadlines = {}
        for replica in group:
            if replica.popen is None:
                if replica.state != State.FAILED:  # the reason everything stops stays shown
                    replica.state = State.STOPPED
                continue
            replica.state = State.STOPPING
            replica.popen.send_signal(signal.SIGTERM)  # the leader only, as the kubelet does
            deadlines[replica] = self.clock() + replica.process.stop_timeout_s
        return deadlines

    def _wait(
        self, deadlines: dict[Replica, float], force: threading.Event, on_tick: Callable[[], None]
    ) -> None:
        """Until each replica has exited, or is killed at its deadline or when `force` is set."""
        while deadlines:
            for replica, deadline in list(deadlines.items()):
                assert replica.popen is not None  # only started replicas have a deadline
                if replica.popen.poll() is not None or force.is_set() or self.clock() >= deadline:
                    self._kill(
                        replica,
                        "at once, as asked"
                        if force.is_set()
                        else f"it did not stop within {replica.process.stop_timeout_s:g} s",
                    )
                    del deadlines[replica]
            on_tick()
            if deadlines:
                time.sleep(0.1)

    def _may_start(self, replica: Replica) -> bool:
        return all(
            any(
                other.process.role == role and other.state == State.READY for other in self.replicas
            )
            for role in replica.process.waits_for
        )

    def _start(self, replica: Replica) -> None:
        process = replica.process
        if replica.state == State.BACKOFF:
            replica.restarts += 1
        with replica.log_path.open("ab") as log:
            what = f"restart {replica.restarts}" if replica.restarts else "start"
            log.write(
                f"--- kubesgl up, {time.strftime('%H:%M:%S')}, {what}: {shlex.join(process.argv)}\n".encode()
            )
            log.flush()
            try:
                replica.popen = subprocess.Popen(
                    process.argv,
                    env=process.environment(os.environ),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=process.pass_fds,
                    preexec_fn=functools.partial(_drain_when_parent_dies, os.getpid())
                    if _LIBC is not None
                    else None,
                )
            except (OSError, subprocess.SubprocessError) as error:  # limits, a program gone
                replica.last_exit = f"could not start: {error}"
                log.write(f"{replica.last_exit}\n".encode())
                replica.started_at = self.clock()
                self._back_off(replica, replica.last_exit)
                return
        replica.state = State.STARTING
        replica.started_at = self.clock()
        self.on_event(replica, f"started, pid {replica.pid}")

    def _died(self, replica: Replica) -> None:
        assert replica.popen is not None
        code = replica.popen.returncode
        _kill_group(replica.popen.pid)  # what it leaves behind, its scheduler processes for example
        replica.popen = None
        replica.last_exit = exit_reason(code, replica.log_path)
        # its first start, never ready: a later one may meet what an earlier run left (a port)
        if code == CONFIGURATION_ERROR_EXIT and not (replica.restarts or replica.has_been_ready):
            replica.state = State.FAILED
            # its last line goes to standard error once, for every replica it stopped
            self.on_event(replica, "exited with status 2, a configuration error: not restarting")
            return
        self._back_off(replica, f"exited ({replica.last_exit})")

    def _back_off(self, replica: Replica, what: str) -> None:
        """Due to start again after the crash loop's delay; `what` happened is the event."""
        ran = self.clock() - replica.started_at
        replica.deaths_in_a_row = 1 if ran >= BACKOFF_RESET_S else replica.deaths_in_a_row + 1
        delay = restart_delay(replica.deaths_in_a_row)
        replica.state, replica.restart_at = State.BACKOFF, self.clock() + delay
        when = f"in {delay:g} s" if delay else "now"
        self.on_event(replica, f"{what}; restarting {when}")

    def _take_health(self, replica: Replica, health: Health) -> None:
        if health.ok and replica.state != State.READY:
            replica.state = State.READY
            replica.has_been_ready = True
            self.on_event(replica, f"ready on {_where(replica.process)}")
            if replica.process.role != contract.ROUTER:
                self._tell_routers()
        elif not health.ok and replica.state == State.READY:
            replica.state = State.UNREADY
            self.on_event(replica, f"not ready: /health fails ({health.why})")

    def _tell_routers(self) -> None:
        """An engine turned ready: the router checks the workers out of its pool now instead of
        at its next health check, up to 5 s later. Only once it has answered /health: before,
        it may not handle the signal yet, and the signal's default would end it."""
        for router in self.replicas:
            if router.process.role == contract.ROUTER and router.state in (
                State.READY,
                State.UNREADY,
            ):
                assert router.popen is not None  # a dead one is BACKOFF once noticed
                router.popen.send_signal(CHECK_SIGNAL)  # nothing if it just exited

    def _kill(self, replica: Replica, why: str) -> None:
        assert replica.popen is not None
        running = replica.popen.poll() is None
        _kill_group(replica.popen.pid)  # also when the leader has exited: its children may not have
        replica.popen.wait()
        replica.popen = None
        replica.state = State.STOPPED
        replica.killed = running
        self.on_event(replica, f"killed: {why}" if running else "stopped")


def by_reason(replicas: Sequence[Replica]) -> dict[str, str]:
    """Each last exit of the replicas, with the names of those that exited so, comma-separated:
    the replicas of one spec refuse it with one message, said once."""
    names: dict[str, list[str]] = {}
    for replica in replicas:
        if replica.last_exit:
            names.setdefault(replica.last_exit, []).append(replica.process.name)
    return {why: ", ".join(each) for why, each in names.items()}


def restart_delay(deaths_in_a_row: int) -> float:
    """0 for a first death: one exit (a kill, an OOM) is no crash loop, and the kubelet too
    restarts a container's first exit at once; then 1 s, 2 s, 4 s, ... up to BACKOFF_MAX_S."""
    if deaths_in_a_row <= 1:
        return 0.0
    return min(BACKOFF_FIRST_S * 2 ** (deaths_in_a_row - 2), BACKOFF_MAX_S)


def _where(process: LocalProcess) -> str:
    """Its URL, and a prefill engine's bootstrap port: P/D errors name that address."""
    if process.bootstrap_port is None:
        return process.url
    return f"{process.url} (bootstrap port {process.bootstrap_port})"


def exit_reason(returncode: int, log_path: Path) -> str:
    """'killed by SIGKILL', or 'exit code 1' and the last line of the process's log (an error
    that ends a Python process is its last line)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:  # real-time signals (SIGRTMIN+n) have no member in signal.Signals
            return f"killed by signal {-returncode}"
    lines = last_lines(log_path)
    return f"exit code {returncode}: {clip(lines[-1])}" if lines else f"exit code {returncode}"


def _drain_when_parent_dies(parent: int) -> None:
    """Run in the child between fork and exec: SIGTERM when `parent` is gone, and at once if it
    went before this was set."""
    assert _LIBC is not None
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _kill_group(pgid: int) -> None:
    """SIGKILL to every process of the group, then a bounded wait until none runs."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_WAIT_S
    while _group_runs(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_runs(pgid: int) -> bool:
    """Whether a process of the group runs, zombies aside (their parents reap them); Linux's
    /proc tells, elsewhere the signal's delivery is trusted."""
    try:
        entries = os.listdir("/proc")
    except FileNotFoundError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
