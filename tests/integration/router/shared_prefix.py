"""Shared-prefix workload and the measurement of issue 4's cache-aware routing check.

The workload: `groups` long system prompts, each asked `questions` different questions,
interleaved at random, sent through the router as chat completions with bounded concurrency.
The measure: the engines' own `kubesgl_prefix_cache_hit_ratio`, averaged over the engines
weighted by their `kubesgl_prompt_tokens_total`; and the router's per-worker in-flight loads,
sampled after every answer, to check they stay inside the balance thresholds.
The same harness runs against fake engines now and against `kubesgl serve` engines later.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field

import httpx

_WORDS = (
    "cache prefix token decode prefill router engine batch kernel tensor memory page radix "
    "schedule latency stream request worker model layer attention value key query"
).split()


@dataclass(frozen=True)
class SharedPrefixWorkload:
    groups: int = 8
    questions: int = 16
    system_words: int = 400
    question_words: int = 12
    max_tokens: int = 4
    seed: int = 0

    def requests(self) -> list[dict[str, object]]:
        rng = random.Random(self.seed)
        systems = [
            f"You are assistant number {g}. " + " ".join(rng.choices(_WORDS, k=self.system_words))
            for g in range(self.groups)
        ]
        requests = [
            {
                "model": "default",
                "messages": [
                    {"role": "system", "content": system},
                    {
                        "role": "user",
                        "content": f"Question {q}: "
                        + " ".join(rng.choices(_WORDS, k=self.question_words)),
                    },
                ],
                "max_tokens": self.max_tokens,
                "temperature": 0,
            }
            for system in systems
            for q in range(self.questions)
        ]
        rng.shuffle(requests)
        return requests


@dataclass
class WorkloadResult:
    statuses: list[int] = field(default_factory=list)
    load_samples: list[list[float]] = field(default_factory=list)  # in-flight per worker

    def max_load_gap(self) -> float:
        return max((max(s) - min(s) for s in self.load_samples if s), default=0.0)


def _series(text: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]


async def run_workload(
    router_url: str, requests: list[dict[str, object]], concurrency: int
) -> WorkloadResult:
    result = WorkloadResult()
    queue: asyncio.Queue[dict[str, object]] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)

    async with httpx.AsyncClient(base_url=router_url, timeout=120.0) as client:

        async def user() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                response = await client.post("/v1/chat/completions", json=body)
                result.statuses.append(response.status_code)
                metrics = (await client.get("/metrics")).text
                result.load_samples.append(_series(metrics, "kubesgl_router_worker_load"))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return result


async def prefix_hit_ratio(engine_urls: list[str]) -> float:
    """Hit ratio over all engines, each weighted by the prompt tokens it processed."""
    hits = weights = 0.0
    async with httpx.AsyncClient(timeout=10.0) as client:
        for url in engine_urls:
            text = (await client.get(url + "/metrics")).text
            ratio = sum(_series(text, "kubesgl_prefix_cache_hit_ratio"))
            tokens = sum(_series(text, "kubesgl_prompt_tokens_total"))
            hits += ratio * tokens
            weights += tokens
    return hits / weights if weights else 0.0
