"""Prefill/decode disaggregation on two GPUs against two mixed engines on the same two GPUs
(two-GPU issue): 1 prefill engine on GPU 0 and 1 decode engine on GPU 1, KV over NIXL (CUDA
IPC between the GPUs), against a mixed engine on each GPU, all behind `kubesgl router`, on the
same Poisson arrivals.

For every workload (input/output tokens) and rate, and every setup: TTFT and ITL p50/p99,
output tokens/s, goodput (requests whose TTFT and own ITL p99 meet the SLO, per second), and for
P/D the KV handoff's mean time and bandwidth from the prefill engine's metrics. P/D runs twice:
every request disaggregated, and with the router's conditional disaggregation at its default
(`--pd-min-prefill-tokens` 128: short uncached prompts prefilled on the decode engine), which
is where short prompts can win back what a handoff costs them.

    python benchmarks/pd_two_gpus.py --model benchmarks/models/llama-3.1-8b --load-format dummy --dtype bfloat16 \\
        --out benchmarks/results/pd_two_gpus_llama8b.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import bench_serving, free_port, report
from pd_one_gpu import EngineProcess, add_engine_options, metric, serving_stack

# NVLink multicast stays off on shared GPU hosts (benchmarks/README.md, two GPUs).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def setups(opts: argparse.Namespace) -> dict:
    """name -> (engines, router workers from their URLs)."""
    bootstrap = free_port()
    prefill = EngineProcess(
        "prefill", ("--role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)), "0"
    )
    decode = EngineProcess("decode", ("--role", "decode"), "1")

    def pd(min_prefill_tokens: int | None):
        extra = (
            []
            if min_prefill_tokens is None
            else ["--pd-min-prefill-tokens", str(min_prefill_tokens)]
        )
        return [prefill, decode], lambda urls: [
            "--prefill",
            f"{urls['prefill']}@{bootstrap}",
            "--decode",
            urls["decode"],
            *extra,
        ]

    return {
        "mixed_x2": (
            [EngineProcess("mixed0", (), "0"), EngineProcess("mixed1", (), "1")],
            lambda urls: ["--worker", urls["mixed0"], urls["mixed1"]],
        ),
        "pd_1p1d": pd(0),
        "pd_1p1d_conditional": pd(None),
    }


def workloads(opts: argparse.Namespace) -> list[tuple[int, int, float]]:
    """(input tokens, output tokens, request rate) for `--workloads 4096x256@1,2,4 512x256@4,16`."""
    runs = []
    for spec in opts.workloads:
        shape, rates = spec.split("@")
        input_len, output_len = (int(x) for x in shape.split("x"))
        runs += [(input_len, output_len, float(rate)) for rate in rates.split(",")]
    return runs


def bench(
    router: str,
    input_len: int,
    output_len: int,
    rate: float,
    opts: argparse.Namespace,
) -> dict:
    num_prompts = max(opts.min_prompts, int(rate * opts.seconds_per_run))
    return bench_serving(
        router,
        "--model",
        "bench",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--vocab-size",
        str(opts.vocab_size),
        "--request-rate",
        str(rate),
        "--num-prompts",
        str(num_prompts),
        "--goodput",
        str(opts.slo_ttft_ms),
        str(opts.slo_itl_ms),
        check=False,  # a run with failed requests still reports them
    )


def handoff(
    urls: dict, before: tuple[float, float, float] | None
) -> tuple[tuple[float, float, float], dict]:
    """The prefill engine's KV write counters now, and their change since `before`."""
    if "prefill" not in urls:
        return (0.0, 0.0, 0.0), {}
    now = tuple(
        metric(urls["prefill"], name)
        for name in (
            "kubesgl_kv_transfer_seconds_sum",
            "kubesgl_kv_transfer_seconds_count",
            "kubesgl_kv_transfer_bytes_total",
        )
    )
    if before is None:
        return now, {}
    seconds, writes, nbytes = (a - b for a, b in zip(now, before))
    if not writes:
        return now, {"writes": 0}
    return now, {
        "writes": writes,
        "seconds_mean": seconds / writes,
        "bytes_per_request": nbytes / writes,
        "gbytes_per_s": nbytes / seconds / 1e9 if seconds else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser, max_total_tokens=400_000)
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["4096x256@1,2,4", "512x256@4,16"],
        help="INPUTxOUTPUT@RATE,RATE,...",
    )
    parser.add_argument(
        "--seconds-per-run", type=float, default=40.0, help="requests = rate x this"
    )
    parser.add_argument("--min-prompts", type=int, default=20)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": opts.model,
        "load_format": opts.load_format,
        "attention_backend": opts.attention_backend,
        "slo_ms": [opts.slo_ttft_ms, opts.slo_itl_ms],
        "runs": [],
    }
    for name, (engines, workers) in setups(opts).items():
        with (
            tempfile.TemporaryDirectory() as log_dir,
            serving_stack(engines, workers, opts, log_dir) as (router, urls),
        ):
            for input_len, output_len, rate in workloads(opts):
                counters, _ = handoff(urls, None)
                serving = bench(router, input_len, output_len, rate, opts)
                _, kv = handoff(urls, counters)
                result["runs"].append(
                    {
                        "setup": name,
                        "input_len": input_len,
                        "output_len": output_len,
                        "rate": rate,
                        "ttft_ms": serving["ttft_ms"],
                        "itl_ms": serving["itl_ms"],
                        "output_token_throughput": serving["output_token_throughput"],
                        "goodput_requests_per_s": serving["goodput_requests_per_s"],
                        "slo_attainment": serving["slo_attainment"],
                        "failed": serving["failed"],
                        "kv_handoff": kv,
                    }
                )
    report(result, opts.out)


if __name__ == "__main__":
    main()
