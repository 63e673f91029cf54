"""What `kubesgl up` shows: on a terminal, a table redrawn in place (each replica's state, pid,
ports, device, restarts, and requests and tokens/s read from its /metrics) above the latest
events; elsewhere (a log file, a pipe), each event as a line."""

from __future__ import annotations

import shutil
import textwrap
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubesgl import contract
from kubesgl.up.plan import LocalPlan, LocalProcess
from kubesgl.up.supervisor import Replica, State, all_ready, by_reason

SCRAPE_INTERVAL_S = 1.0
SHOWN_EVENTS = 8
# The states whose replicas' /metrics are read, and whose rates the table shows: a stopped
# process's last requests running and tokens/s are no longer true (its requests served are).
SCRAPED = frozenset({State.READY, State.UNREADY})


@dataclass(frozen=True)
class Counters:
    """A process's request and token counts at one moment (engines; the router counts requests)."""

    requests: float  # finished (engines) or answered (router)
    running: float
    tokens: float  # generated
    at: float
    pid: int | None = None  # the process read: a restarted one's counts start again


def read_counters(
    client: httpx.Client, url: str, role: contract.PodRole, pid: int | None = None
) -> Counters | None:
    """The counts of process `pid`; None where it answers no readable /metrics (yet): it may
    be loading, or failing."""
    try:
        response = client.get(url + "/metrics", timeout=1.0)
        response.raise_for_status()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except (httpx.HTTPError, ValueError):  # ValueError: not Prometheus' text format
        return None
    if role == contract.ROUTER:
        # client requests: the requests counter counts each upstream attempt (two per P/D request)
        return Counters(
            totals.get("kubesgl_router_request_duration_seconds_count", 0.0),
            0.0,
            0.0,
            time.monotonic(),
            pid,
        )
    return Counters(
        totals.get("kubesgl_requests_total", 0.0),
        totals.get("kubesgl_num_running_requests", 0.0),
        totals.get("kubesgl_generation_tokens_total", 0.0),
        time.monotonic(),
        pid,
    )


class StatusView:
    def __init__(self, plan: LocalPlan, log_dir: Path, out: TextIO, live: bool):
        self.plan = plan
        self.out = out
        self.live = live
        self.started = time.monotonic()
        self.ready_once = False
        self.header = [
            f"kubesgl up: {plan.name} ({plan.mode})   Ctrl-C stops everything",
            f"OpenAI base URL: {plan.base_url}",
            f"model: {plan.model_path}",
            f"logs: {log_dir}",
        ]
        self.events: deque[str] = deque(maxlen=SHOWN_EVENTS)
        self._client = httpx.Client()
        self._counters: dict[
            str, tuple[Counters | None, Counters | None]
        ] = {}  # name: (previous, latest)
        self._scraped_at = 0.0
        self._reader = ThreadPoolExecutor(1, "kubesgl-up-metrics")
        self._round: Future[dict[str, Counters | None]] | None = None
        self._drawn_lines = 0
        if not live:
            self._print(*self.header)

    def note(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        self.events.append(line)
        if not self.live:
            self._print(line)

    def event(self, replica: Replica, message: str) -> None:
        self.note(f"{replica.process.name}: {message}")

    def refresh(self, replicas: list[Replica]) -> None:
        if not self.ready_once and all_ready(replicas):
            self.ready_once = True
            self.note(
                f"ready in {time.monotonic() - self.started:.1f} s: OpenAI base URL {self.plan.base_url}"
            )
        if not self.live:
            return
        if time.monotonic() - self._scraped_at >= SCRAPE_INTERVAL_S:
            self._scrape(replicas)
        width = shutil.get_terminal_size().columns
        table = [*self.header, "", *format_table(replicas, self._counters), ""]
        # the table's lines cut at the terminal's width, the events' wrapped: each is read whole
        lines = [line[:width] for line in table] + [
            part
            for event in self.events
            for part in textwrap.wrap(event, width, subsequent_indent="  ")
        ]
        # back to the top of the previous drawing, which is cleared: the table stays in place
        prefix = f"\x1b[{self._drawn_lines}F\x1b[J" if self._drawn_lines else ""
        self.out.write(prefix + "".join(line + "\n" for line in lines))
        self.out.flush()
        self._drawn_lines = len(lines)

    def close(self) -> None:
        self._reader.shutdown(wait=True)  # a round still reading ends within its timeouts
        self._client.close()

    def _print(self, *lines: str) -> None:
        self.out.write("".join(line + "\n" for line in lines))
        self.out.flush()

    def _scrape(self, replicas: list[Replica]) -> None:
        """Takes in the last round of reads once it is done, and starts the next: a /metrics
        that hangs holds up its round (1 s a read), never the supervisor's tick."""
        if self._round is not None:
            if not self._round.done():
                return
            for name, latest in self._round.result().items():
                self._counters[name] = (self._counters.get(name, (None, None))[1], latest)
        self._scraped_at = time.monotonic()
        # a replica not read keeps its last counts: its requests served stay shown once stopped
        targets = [(r.process, r.pid) for r in replicas if r.state in SCRAPED]
        self._round = self._reader.submit(self._read_round, targets)

    def _read_round(
        self, targets: list[tuple[LocalProcess, int | None]]
    ) -> dict[str, Counters | None]:
        return {
            process.name: read_counters(self._client, process.url, process.role, pid)
            for process, pid in targets
        }


# REQS: requests finished (engines) or answered (router); BOOT: a prefill engine's bootstrap port
COLUMNS = ("NAME", "STATE", "PID", "PORT", "BOOT", "DEVICE", "RESTARTS", "REQS", "RUNNING", "TOK/S")


def format_table(
    replicas: list[Replica], counters: dict[str, tuple[Counters | None, Counters | None]]
) -> list[str]:
    rows = [COLUMNS]
    for replica in replicas:
        process = replica.process
        previous, latest = counters.get(process.name, (None, None))
        if process.role == contract.ROUTER:
            device = "-"
        else:
            device = f"gpu {','.join(process.gpus)}" if process.gpus else "cpu"
        state = replica.state.value
        if replica.state == State.BACKOFF:
            state += f" ({max(0.0, replica.restart_at - time.monotonic()):.0f} s)"
        requests = running = tokens_per_s = "-"
        if latest is not None:
            requests = f"{latest.requests:.0f}"
            if process.role != contract.ROUTER and replica.state in SCRAPED:
                running = f"{latest.running:.0f}"
                if previous is not None and previous.pid == latest.pid and latest.at > previous.at:
                    tokens_per_s = (
                        f"{(latest.tokens - previous.tokens) / (latest.at - previous.at):.1f}"
                    )
        rows.append(
            (
                process.name,
                state,
                str(replica.pid or "-"),
                str(process.port),
                str(process.bootstrap_port or "-"),
                device,
                str(replica.restarts),
                requests,
                running,
                tokens_per_s,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    for why, names in by_reason(replicas).items():
        lines.append(f"{names} last exited: {why}")
    return lines
