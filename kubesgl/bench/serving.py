"""`kubesgl bench serving`: drive a server with a request set at a request rate (Poisson
arrivals) or a fixed concurrency, streaming every answer, and report TTFT, TPOT, ITL and
end-to-end latency percentiles with request and token throughputs (printed, and written as
JSON to --output-file where given). The shape follows SGLang's bench_serving."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kubesgl.bench.datasets import (
    FIRST_TOKEN_ID,
    BenchRequest,
    random_requests,
    shared_prefix_requests,
    sharegpt_like_requests,
)
from kubesgl.cli_help import CommandParser, DefaultsOnce, above_zero, at_least, fraction


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0  # tokens received
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


async def send(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=len(request.prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                )
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    concurrency: int | None,
    seed: int,
    headers: dict[str, str] | None = None,  # e.g. the API key's
) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=concurrency or 1000, max_keepalive_connections=concurrency or 1000
    )
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(3600), limits=limits
    ) as client:

        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send(client, model, request)
            async with semaphore:
                return await send(client, model, request)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of a sorted, non-empty list: the value at rank floor(q * n)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "mean": statistics.mean(values) * scale,
        "p50": percentile(ordered, 0.5) * scale,
        "p90": percentile(ordered, 0.9) * scale,
        "p99": percentile(ordered, 0.99) * scale,
    }


@dataclass(frozen=True)
class Slo:
    """A request meets it when its TTFT and the 99th percentile of its own inter-token gaps
    are within bounds: goodput counts such requests per second."""

    ttft_s: float
    itl_s: float

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok or result.ttft > self.ttft_s:
            return False
        gaps = sorted(result.itls)
        return not gaps or gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] <= self.itl_s


def summarize(results: list[RequestResult], duration: float, slo: Slo | None = None) -> dict:
    done = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    output_tokens = sum(r.output_len for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_token_throughput": sum(r.prompt_len for r in done) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in done for x in r.itls]),
        "e2e_ms": percentiles([r.e2e for r in done]),
        **(
            {
                "slo": {"ttft_ms": slo.ttft_s * 1e3, "itl_ms": slo.itl_s * 1e3},
                "slo_attainment": sum(map(slo.met_by, results)) / len(results),
                "goodput_requests_per_s": sum(map(slo.met_by, results)) / duration,
            }
            if slo
            else {}
        ),
    }


# Each --dataset's request set, from the command line, the vocabulary size and a seeded rng.
DATASETS: dict[str, Callable[[argparse.Namespace, int, random.Random], list[BenchRequest]]] = {
    "random": lambda args, vocab, rng: random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        vocab,
        rng,
    ),
    "shared-prefix": lambda args, vocab, rng: shared_prefix_requests(
        args.num_prompts,
        args.prefix_groups,
        args.system_prompt_len,
        args.question_len,
        args.random_output_len,
        vocab,
        rng,
    ),
    "sharegpt": lambda args, vocab, rng: sharegpt_like_requests(
        args.num_prompts, args.max_context_len, vocab, rng
    ),
}


def build_requests(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    return DATASETS[args.dataset](args, vocab, random.Random(args.seed))


def server_root(url: str) -> str:
    """The server's root URL, to which the benchmark adds /v1/models, /model_info and
    /v1/completions: the OpenAI base URL (`.../v1`, which `kubesgl up` prints) and a trailing
    slash are taken too, which would otherwise make every route /v1/v1/... or //..., a 404."""
    return url.rstrip("/").removesuffix("/v1")


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="kubesgl bench serving", description=__doc__, formatter_class=DefaultsOnce
    )
    parser.add_argument(
        "--base-url",
        required=True,
        type=server_root,
        metavar="URL",
        help="the server (an engine or the router), e.g. http://127.0.0.1:30000, or its OpenAI"
        " base URL (http://127.0.0.1:30000/v1)",
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument(
        "--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--dataset",
        choices=list(DATASETS),
        default="random",
        help="random lengths; a few long system prompts shared by many questions; or "
        "conversation-like lengths (kubesgl/bench/datasets.py)",
    )
    parser.add_argument(
        "--num-prompts", type=at_least(1), default=100, metavar="N", help="requests sent"
    )
    parser.add_argument(
        "--random-input-len",
        type=at_least(1),
        default=1024,
        metavar="N",
        help="random: prompt tokens (the most, with --random-range-ratio)",
    )
    parser.add_argument(
        "--random-output-len",
        type=at_least(1),
        default=128,
        metavar="N",
        help="random and shared-prefix: output tokens (the most, with --random-range-ratio)",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=fraction,
        default=1.0,
        metavar="X",
        help="lengths are drawn in [ratio * len, len]; 1.0 makes them fixed",
    )
    parser.add_argument(
        "--prefix-groups",
        type=at_least(1),
        default=8,
        metavar="N",
        help="shared-prefix: system prompts the requests share",
    )
    parser.add_argument(
        "--system-prompt-len",
        type=at_least(0),
        default=1024,
        metavar="N",
        help="shared-prefix: tokens of each system prompt (0: none, a baseline without sharing)",
    )
    parser.add_argument(
        "--question-len",
        type=at_least(1),  # so that no prompt is empty, whatever --system-prompt-len
        default=64,
        metavar="N",
        help="shared-prefix: tokens of each question after its system prompt",
    )
    parser.add_argument(
        "--max-context-len",
        type=at_least(2),  # a prompt gets half of it, and each needs a token
        default=4096,
        metavar="N",
        help="sharegpt: longest prompt + output",
    )
    parser.add_argument(
        "--vocab-size",
        type=at_least(FIRST_TOKEN_ID + 1),  # as vocab_size_of asks of the server's
        default=None,
        metavar="N",
        help="prompt token ids are drawn below this (default: the server's vocabulary size, "
        "from SGLang's GET /model_info, which kubesgl's engines and router answer)",
    )
    parser.add_argument(
        "--request-rate",
        type=above_zero("a number", "no limit"),
        default=float("inf"),
        metavar="X",
        help="requests/s (Poisson); inf = all at once",
    )
    parser.add_argument(
        "--max-concurrency",
        type=at_least(1),
        default=None,
        metavar="N",
        help="requests in flight at most (default: no limit)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seeds the request set and the arrivals"
    )
    parser.add_argument(
        "--goodput",
        nargs=2,
        type=above_zero("milliseconds", "no bound"),
        default=None,
        metavar=("TTFT_MS", "ITL_MS"),
        help="also count requests whose TTFT and own ITL p99 are within these bounds (goodput);"
        " inf leaves that one unbounded",
    )
    parser.add_argument(
        "--output-file", default=None, metavar="FILE", help="write the results as JSON here"
    )
    return parser


class BenchSetupError(Exception):
    """What the server did not tell before the benchmark could start; one line."""


def _ask(base_url: str, path: str, headers: dict[str, str]) -> dict:
    try:
        answer = httpx.get(base_url + path, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise BenchSetupError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
    if answer.status_code != 200:
        hint = " (give --api-key)" if answer.status_code == 401 else ""
        raise BenchSetupError(
            f"GET {base_url}{path}: HTTP {answer.status_code}{hint}: {answer.text[:200]}"
        )
    try:
        return answer.json()
    except ValueError:
        raise BenchSetupError(f"GET {base_url}{path}: the answer is not JSON") from None


def vocab_size_of(base_url: str, headers: dict[str, str]) -> int:
    """The server's vocabulary size, from SGLang's GET /model_info: prompt token ids must be
    below it (a fixed guess such as 32000 fails every request to a model with a smaller one)."""
    try:
        vocab = _ask(base_url, "/model_info", headers).get("vocab_size")
    except BenchSetupError as exc:
        raise BenchSetupError(
            f"{exc}; give the model's vocabulary size with --vocab-size N"
        ) from None
    if not isinstance(vocab, int) or vocab <= FIRST_TOKEN_ID:
        raise BenchSetupError(
            f"GET {base_url}/model_info names no vocabulary size (got {vocab!r}); "
            "give it with --vocab-size N"
        )
    return vocab


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or _ask(args.base_url, "/v1/models", headers)["data"][0]["id"]
        vocab = args.vocab_size or vocab_size_of(args.base_url, headers)
    except BenchSetupError as exc:
        print(f"kubesgl bench serving: {exc}", file=sys.stderr)
        return 2
    requests = build_requests(args, vocab)
    results, duration = asyncio.run(
        run(
            args.base_url,
            model,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            headers=headers,
        )
    )
    slo = Slo(args.goodput[0] / 1e3, args.goodput[1] / 1e3) if args.goodput else None
    summary = {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        **summarize(results, duration, slo),
    }
    summary["config"]["request_rate"] = str(args.request_rate)
    summary["config"]["vocab_size"] = vocab
    print(format_table(summary))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def format_table(summary: dict) -> str:
    lines = [
        f"completed {summary['completed']}, failed {summary['failed']} in {summary['duration_s']:.2f} s",
        f"request throughput {summary['request_throughput']:.2f} req/s, output "
        f"{summary['output_token_throughput']:.1f} tok/s, input {summary['input_token_throughput']:.1f} tok/s",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[name]
        if p:
            lines.append(
                f"{name:8} mean {p['mean']:9.2f}  p50 {p['p50']:9.2f}  p90 {p['p90']:9.2f}  p99 {p['p99']:9.2f}"
            )
    if "slo" in summary:
        lines.append(
            f"goodput {summary['goodput_requests_per_s']:.2f} req/s ({summary['slo_attainment']:.0%} of "
            f"requests within TTFT {summary['slo']['ttft_ms']:g} ms and ITL p99 {summary['slo']['itl_ms']:g} ms)"
        )
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)
