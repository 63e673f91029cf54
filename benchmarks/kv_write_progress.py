"""What the wait of NIXL's progress thread between passes costs and saves for KV pools on a GPU
or in host memory: how late a KV write is seen done (by the prefill side, which frees the
room) and its note seen (by the decode side, whose request then decodes), and how much CPU an
idle agent burns.

engine/disagg/kv_transfer.py gives UCX's progress thread a wait of 1 ms (polled without a
pause, an idle engine rank kept a core busy), chosen from this script's figures in host
memory and on an H100. It measures: two processes on one GPU (or the CPU), each with a
KVTransferAgent over a pool of the Llama-3.1-8B shape (32 layers, 8 KV heads of 128, bf16:
128 KiB a token), as a prefill and a decode engine have. For each wait in --delays-us, the
prefill side writes --tokens tokens (contiguous, then scattered in runs of 16 as a paged pool
holds them) --repeats times, polling `done` and the decode side polling its notifications
without a pause; a poll loop the scheduler does not have, so the times are what the agents
allow, not what an engine's step adds. Then both sleep and count their CPU time.

    python benchmarks/kv_write_progress.py --delays-us 0,100,1000 --tokens 512,4096 \\
        --repeats 10 --out benchmarks/results/kv_write_progress_h100.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import statistics
import time

import torch

from kubesgl.engine.disagg import kv_transfer
from kubesgl.engine.disagg.kv_transfer import KVTransferAgent
from kubesgl.engine.kvcache.pools import KVPool

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
IDLE_S = 3.0


def agent_with_delay(pool: KVPool, delay_us: int) -> KVTransferAgent:
    """A KVTransferAgent whose progress thread waits `delay_us` between passes, in place of
    the engine's PROGRESS_THREAD_DELAY_US."""
    make = kv_transfer._nixl_agent
    kv_transfer._nixl_agent = lambda name, _chosen: make(name, delay_us)  # type: ignore[assignment]
    try:
        return KVTransferAgent(pool)
    finally:
        kv_transfer._nixl_agent = make  # type: ignore[assignment]


def pool(slots: int, device: str) -> KVPool:
    return KVPool(slots, LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device(device))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def idle_cpu_share() -> float:
    """The cores this process kept busy while its main thread slept (its agent's threads)."""
    before = cpu_seconds()
    time.sleep(IDLE_S)
    return (cpu_seconds() - before) / IDLE_S


def decode_side(conn, delay_us: int, slots: int, device: str) -> None:
    agent = agent_with_delay(pool(slots, device), delay_us)
    conn.send((agent.metadata, agent.layout))
    expected = conn.recv()
    seen: list[int] = []
    while len(seen) < expected:
        notes = agent.notifications()
        seen += [time.monotonic_ns()] * len(notes)
    conn.send((seen, idle_cpu_share()))
    conn.recv()  # the prefill side is done with this pool
    agent.close()


def write_runs(tokens: int, scattered: bool, rng: random.Random) -> tuple[list[int], list[int]]:
    """Source and destination slots: one run, or runs of 16 in random order."""
    slots = list(range(1, tokens + 1))
    if not scattered:
        return slots, slots
    runs = [slots[i : i + 16] for i in range(0, tokens, 16)]
    rng.shuffle(runs)
    dst = [s for run in runs for s in run]
    rng.shuffle(runs)
    return [s for run in runs for s in run], dst


def measure(delay_us: int, args: argparse.Namespace) -> dict:
    slots = max(args.tokens) + 1  # slot 0 is the pool's padding
    cases = [(t, scattered) for t in args.tokens for scattered in (False, True)]
    here, there = mp.Pipe()
    child = mp.get_context("spawn").Process(
        target=decode_side, args=(there, delay_us, slots, args.device)
    )
    child.start()
    metadata, layout = here.recv()
    agent = agent_with_delay(pool(slots, args.device), delay_us)
    agent.connect(metadata, layout)
    here.send(len(cases) * (args.repeats + 1))
    rng = random.Random(0)
    started, finished = [], []
    for tokens, scattered in cases:
        src, dst = write_runs(tokens, scattered, rng)
        for _ in range(args.repeats + 1):  # the first of each warms up
            begin = time.monotonic_ns()
            transfer = agent.write(layout.agent, src, dst, b"room")
            while not agent.done(transfer):
                pass
            started.append(begin)
            finished.append(time.monotonic_ns())
            time.sleep(0.05)  # the note is seen before the next write starts
    noted, decode_idle = here.recv()
    prefill_idle = idle_cpu_share()
    here.send(None)
    child.join()
    agent.close()
    results, i = [], 0
    for tokens, scattered in cases:
        done_ms, note_ms = [], []
        for r in range(args.repeats + 1):
            if r:
                done_ms.append((finished[i] - started[i]) / 1e6)
                note_ms.append((noted[i] - started[i]) / 1e6)
            i += 1
        results.append(
            {
                "tokens": tokens,
                "scattered": scattered,
                "mib": tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 2**20,
                "done_ms_median": statistics.median(done_ms),
                "done_ms_max": max(done_ms),
                "note_ms_median": statistics.median(note_ms),
                "note_ms_max": max(note_ms),
            }
        )
    return {
        "delay_us": delay_us,
        "idle_cores_prefill_process": prefill_idle,
        "idle_cores_decode_process": decode_idle,
        "writes": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delays-us", default="0,100,1000")
    parser.add_argument("--tokens", default="512,4096", help="tokens per write (a list)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda:0", help="where the pools are (cpu: host memory)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no GPU here: --device cpu measures pools in host memory")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    runs = [measure(int(d), args) for d in args.delays_us.split(",")]
    on_gpu = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(args.device) if on_gpu else "cpu"
    text = json.dumps({"device": where, "runs": runs}, indent=2)
    print(
        text
    )  # common.report's format, without importing the engine (the GPU host lacks its deps)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
