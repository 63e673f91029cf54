"""How long a killed engine of `kubesgl up` keeps requests from being answered.

Each round starts `kubesgl up -f FILE` afresh (so that each kill is the replica's first exit),
waits for it to be ready and a random 2 to 7 s more (the router's health checks, every 5 s, are
at any phase of it then), and kills `--replica` with SIGKILL. From the kill it times
- `restarted`: `kubesgl up` says the replica started again;
- `engine_ready`: the replica's own /health answers 200 (polled every 50 ms);
- `router_ready`: the router's GET /workers shows it healthy again;
- `first_200`: a completion through the router is answered 200 (sent from `router_ready` on);
and sends, right after the kill, one completion through the OpenAI SDK with its default two
retries (which wait the router's `Retry-After`), whose outcome it records.

Run from a checkout's root; with `--baseline DIR` (another checkout) the rounds alternate
between DIR and this one, so that other load on the machine weighs on both alike.

    python benchmarks/up_recovery.py --rounds 5 --baseline ../kubesgl-368b19d \
        --out benchmarks/results/up_recovery.json
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
from common import free_port, report

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


class Up:
    """`kubesgl up` with its output in a file, read as it grows."""

    def __init__(self, tree: Path, spec: str, port: int) -> None:
        """`kubesgl up` of the checkout at `tree`, `spec` relative to it."""
        folder = Path(tempfile.mkdtemp(prefix="up-recovery-"))
        self.out = folder / "up.out"
        with self.out.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kubesgl", "up", "-f", spec, "--port", str(port),
                 "--logs", str(folder / "logs")],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
            )  # fmt: skip

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 300) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.text()[after:], re.M)):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"no {pattern!r} from kubesgl up:\n{self.text()}")
            time.sleep(0.01)
        return found

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


@dataclass
class Round:
    """Seconds from the kill (the module's docstring), and the SDK request's outcome."""

    restarted: float
    engine_ready: float
    router_ready: float
    first_200: float
    sdk_status: int  # its last answer's
    sdk_seconds: float


def sdk_request(base_url: str, outcome: list[tuple[int, float]]) -> None:
    started = time.monotonic()
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=60)
    try:
        client.completions.create(**BODY)
        status = 200
    except openai.APIStatusError as error:
        status = error.status_code
    except openai.APIConnectionError:
        status = 0  # the router did not answer: it never should
    outcome.append((status, round(time.monotonic() - started, 2)))


def one_round(tree: Path, spec: str, replica: str) -> Round:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    up = Up(tree, spec, port)
    try:
        up.wait_for(r"ready in [\d.]+ s: OpenAI base URL")
        url = up.wait_for(rf"^\S+ {replica}: ready on (\S+)").group(1)
        http = httpx.Client(base_url=base_url, timeout=10)
        http.post("/v1/completions", json=BODY).raise_for_status()
        time.sleep(random.uniform(2, 7))
        before = len(up.text())
        pid = int(re.findall(rf"^\S+ {replica}: started, pid (\d+)$", up.text(), re.M)[-1])
        sdk: list[tuple[int, float]] = []
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread = threading.Thread(target=sdk_request, args=(base_url, sdk))
        thread.start()
        up.wait_for(rf"^\S+ {replica}: started, pid", after=before)
        restarted = time.monotonic() - killed
        engine_ready = router_ready = None
        while True:
            now = time.monotonic() - killed
            if now > 120:
                raise SystemExit(f"{replica} not back in 120 s:\n{up.text()}")
            if engine_ready is None:
                try:
                    if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                        engine_ready = now
                except httpx.HTTPError:
                    pass
            elif router_ready is None:
                workers = http.get("/workers").json()["workers"]
                if any(w["url"] == url and w["healthy"] for w in workers):
                    router_ready = now
            elif http.post("/v1/completions", json=BODY).status_code == 200:
                break
            time.sleep(0.05)
        first_200 = time.monotonic() - killed
        thread.join()
        (status, seconds), *_ = sdk
        return Round(
            *(round(t, 2) for t in (restarted, engine_ready, router_ready, first_200)),
            sdk_status=status,
            sdk_seconds=seconds,
        )
    finally:
        up.stop()


def commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


def summary(rounds: list[Round]) -> dict[str, object]:
    return {
        "median_seconds_after_kill": {
            key: statistics.median(getattr(r, key) for r in rounds)
            for key in ("restarted", "engine_ready", "router_ready", "first_200")
        },
        "sdk_answered_200": sum(r.sdk_status == 200 for r in rounds),
        "rounds": [asdict(r) for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file", default="examples/quickstart.yaml")
    parser.add_argument("--replica", default="decode-0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", metavar="DIR", type=Path, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trees = {"this": Path.cwd()}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    rounds: dict[str, list[Round]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(one_round(tree, args.file, args.replica))
            print(name, rounds[name][-1], file=sys.stderr, flush=True)
    report(
        {
            "file": args.file,
            "replica": args.replica,
            "cpu_count": os.cpu_count(),
            **{name: {"commit": commit(trees[name]), **summary(r)} for name, r in rounds.items()},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
