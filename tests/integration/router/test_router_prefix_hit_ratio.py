"""Issue 4: cache-aware routing reaches at least twice round robin's prefix-cache hit ratio.

Against fake engines with a bounded simulated prefix cache, and against `kubesgl serve`
engines on a tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from shared_prefix import SharedPrefixWorkload, prefix_hit_ratio, run_workload

from kubesgl.router.policies import CacheAwareSettings

pytestmark = pytest.mark.asyncio

WORKLOAD = SharedPrefixWorkload(groups=8, questions=12)
CONCURRENCY = 8
# Tight enough that imbalance shows within a run of 8 concurrent users.
BALANCE = CacheAwareSettings(balance_abs_threshold=4, balance_rel_threshold=1.5)


async def measure(start_router, engine_urls: list[str], policy: str) -> tuple[float, float]:
    async with start_router(workers=engine_urls, policy=policy, cache_aware=BALANCE) as router:
        await router.all_healthy(timeout=300)
        result = await run_workload(router.url, WORKLOAD.requests(), CONCURRENCY)
    assert set(result.statuses) == {200}
    return await prefix_hit_ratio(engine_urls), result.max_load_gap()


async def test_cache_aware_doubles_the_hit_ratio_on_fake_engines(engines, start_router):
    system_chars = len(WORKLOAD.requests()[0]["messages"][0]["content"])  # type: ignore[index]
    ratios = {}
    for policy in ("round_robin", "cache_aware"):
        # Each engine's cache holds about two system prompts, as a small KV pool would.
        fakes = [
            await engines(
                f"{policy}-{i}", prefix_cache_chars=int(2.5 * system_chars), model="default"
            )
            for i in range(4)
        ]
        ratios[policy], gap = await measure(start_router, [f.url for f in fakes], policy)
        assert gap <= BALANCE.balance_abs_threshold + 1
        for fake in fakes:
            await fake.kill()
    print(f"prefix cache hit ratio on fake engines: {ratios}")
    assert ratios["cache_aware"] >= 2 * ratios["round_robin"], ratios


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def real_engines(
    model_dir: str, count: int, max_total_tokens: int
) -> AsyncIterator[list[str]]:
    """`kubesgl serve` engines on loopback ports (docs/architecture.md, Command line)."""
    ports = [_free_port() for _ in range(count)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubesgl",
                "serve",
                "--model",
                model_dir,
                "--port",
                str(port),
                "--device",
                "cpu",
                "--max-total-tokens",
                str(max_total_tokens),
                "--served-model-name",
                "default",
            ],  # fmt: skip
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for port in ports
    ]
    try:
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


@pytest.mark.slow
async def test_cache_aware_doubles_the_hit_ratio_on_real_engines(start_router, tmp_path):
    model_dir = str(tmp_path / "tiny")
    subprocess.run(
        [sys.executable, "-m", "kubesgl", "make-tiny-model", model_dir, "--arch", "llama"],
        check=True,
    )
    ratios = {}
    for policy in ("round_robin", "cache_aware"):
        # Fresh engines per policy: the hit ratio counts from an empty cache. The KV pool holds
        # about two conversations (the tiny model's tokenizer makes 1350-1450 tokens of each).
        async with real_engines(model_dir, 4, max_total_tokens=2 * 1450 + 300) as urls:
            ratios[policy], gap = await asyncio.wait_for(measure(start_router, urls, policy), 600)
        assert gap <= BALANCE.balance_abs_threshold + 1
    print(f"prefix cache hit ratio on kubesgl serve engines: {ratios}")
    assert ratios["cache_aware"] >= 2 * ratios["round_robin"], ratios
