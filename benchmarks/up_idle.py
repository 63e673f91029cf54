"""What `kubesgl up` costs a laptop: the CPU its processes use while no request comes, and the
latency of one request at a time through the router (P/D for the quickstart).

Starts `kubesgl up -f FILE`, waits for the router's "ready" line, sums the CPU time of every
process it started over `--idle-seconds` (Linux: /proc), then sends `--requests` chat
completions one after another and stops it with Ctrl-C's signal.

    python benchmarks/up_idle.py --file examples/quickstart.yaml --out benchmarks/results/up_idle.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
from common import report

READY = re.compile(r"router: ready on (http://\S+)")


def process_tree(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_ready(up: subprocess.Popen, timeout: float) -> str:
    """The router's URL once `kubesgl up` says it is ready; its output goes on to stderr."""
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            sys.stderr.write(line)
            if not found and (match := READY.search(line)):
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout):
        raise SystemExit(f"kubesgl up was not ready within {timeout:g} s")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--file", default="examples/quickstart.yaml")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--settle-seconds", type=float, default=5.0, help="after ready")
    parser.add_argument("--model", default="tiny", help="the served model's name")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    up = subprocess.Popen(
        [sys.executable, "-m", "kubesgl", "up", "-f", args.file],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = wait_ready(up, args.ready_timeout)
        time.sleep(args.settle_seconds)
        pids = process_tree(up.pid)
        before = cpu_seconds(pids)
        time.sleep(args.idle_seconds)
        idle_cores = (cpu_seconds(pids) - before) / args.idle_seconds

        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": "Hello there, how are you?"}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
        }
        latencies = []
        with httpx.Client(base_url=url, timeout=60) as client:
            client.post("/v1/chat/completions", json=body).raise_for_status()  # first use
            for _ in range(args.requests):
                started = time.perf_counter()
                client.post("/v1/chat/completions", json=body).raise_for_status()
                latencies.append(time.perf_counter() - started)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
    report(
        {
            "file": args.file,
            "cpu_count": os.cpu_count(),
            "processes": len(pids),
            "idle_seconds": args.idle_seconds,
            "idle_cpu_cores": round(idle_cores, 3),
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "latency_ms_median": round(statistics.median(latencies) * 1000, 1),
            "latency_ms_mean": round(statistics.mean(latencies) * 1000, 1),
            "latency_ms_max": round(max(latencies) * 1000, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
