"""`kubesgl bench serving` against a real `kubesgl serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serve_harness import start_router


def bench(base_url: str, tmp_path, *args: str, vocab: str | None = "600") -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    vocab_args = ["--vocab-size", vocab] if vocab else []
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "bench",
            "serving",
            "--base-url",
            base_url,
            *vocab_args,
            "--output-file",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), result.stderr
    return result.returncode, json.loads(out.read_text())


def test_bench_serving_counts_and_latencies(server_factory, tiny_model, tmp_path):
    server = server_factory(tiny_model("llama"))
    code, summary = bench(
        server.base_url,
        tmp_path,
        "--num-prompts",
        "12",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--request-rate",
        "40",
    )
    assert code == 0
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert summary["e2e_ms"]["p50"] >= summary["ttft_ms"]["p50"]
    assert summary["output_token_throughput"] > 0

    code, shared = bench(
        server.base_url,
        tmp_path,
        "--dataset",
        "shared-prefix",
        "--num-prompts",
        "16",
        "--prefix-groups",
        "2",
        "--system-prompt-len",
        "200",
        "--question-len",
        "8",
        "--random-output-len",
        "4",
        "--max-concurrency",
        "1",
    )
    assert code == 0 and shared["completed"] == 16
    # One at a time, so the cache is warm for all but each group's first request: of the
    # 12 * 32 random and 16 * 208 shared-prefix prompt tokens, 14 * 200 come from the cache.
    assert server.metric("kubesgl_prefix_cache_hit_ratio") == pytest.approx(
        14 * 200 / (12 * 32 + 16 * 208)
    )

    code, sharegpt = bench(
        server.base_url,
        tmp_path,
        "--dataset",
        "sharegpt",
        "--num-prompts",
        "6",
        "--max-context-len",
        "512",
        "--max-concurrency",
        "6",
    )
    assert code == 0 and sharegpt["completed"] == 6


def test_bench_serving_reports_failures_and_sends_the_api_key(server_factory, tiny_model, tmp_path):
    server = server_factory(tiny_model("llama"), "--api-key", "secret")
    load = ["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "2"]
    code, summary = bench(server.base_url, tmp_path, "--model", "m", *load)
    assert code == 1 and summary["failed"] == 3 and "HTTP 401" in summary["errors"][0]
    # the key goes with every request, not only with the setup calls
    code, summary = bench(server.base_url, tmp_path, "--api-key", "secret", *load)
    assert code == 0 and summary["completed"] == 3, summary["errors"]
    assert "api_key" not in summary["config"]


def test_the_vocabulary_size_comes_from_the_server_or_through_the_router(
    server_factory, tiny_model, tmp_path
):
    """The README's tiny model has 636 tokens: the 32000 that bench serving used to assume failed
    every request. Without --vocab-size it asks the server (SGLang's GET /model_info), which the
    router answers from a worker."""
    server = server_factory(tiny_model("llama"))
    router = start_router("--worker", server.base_url, tmp_path=tmp_path)
    try:
        for url in (server.base_url, router.base_url):
            code, summary = bench(
                url,
                tmp_path,
                "--num-prompts",
                "8",
                "--random-input-len",
                "64",
                "--random-output-len",
                "2",
                vocab=None,
            )
            assert code == 0 and summary["completed"] == 8, summary["errors"]
            assert summary["config"]["vocab_size"] == 636
    finally:
        router.stop(timeout=30)


def test_a_server_that_does_not_say_its_vocabulary_size_is_a_clear_error(
    server_factory, tiny_model, tmp_path
):
    server = server_factory(tiny_model("llama"), "--api-key", "secret")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "bench",
            "serving",
            "--base-url",
            server.base_url,
            "--model",
            "m",
            "--num-prompts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"kubesgl bench serving: GET {server.base_url}/model_info: HTTP 401 (give --api-key)"
    )
    assert result.stderr.rstrip().endswith("give the model's vocabulary size with --vocab-size N")
