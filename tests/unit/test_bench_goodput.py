"""`kubesgl bench serving --goodput TTFT_MS ITL_MS`: requests within both bounds, per second."""

from __future__ import annotations

from kubesgl.bench.serving import RequestResult, Slo, format_table, summarize


def result(ttft: float, itls: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(
        ok=ok, prompt_len=8, output_len=len(itls) + 1, ttft=ttft, e2e=ttft + sum(itls), itls=itls
    )


def test_goodput_counts_the_requests_within_both_bounds():
    slo = Slo(ttft_s=1.0, itl_s=0.02)
    results = [
        result(0.5, [0.01] * 100),  # meets both
        result(1.5, [0.01] * 100),  # first token too late
        result(0.5, [0.01] * 98 + [0.5, 0.5]),  # its own ITL p99 is 0.5 s
        result(0.5, [0.01] * 200 + [0.5]),  # one slow gap in 201: p99 still 10 ms
        result(0.1, [], ok=False),  # failed
    ]
    summary = summarize(results, duration=2.0, slo=slo)
    assert summary["slo_attainment"] == 2 / 5
    assert summary["goodput_requests_per_s"] == 1.0
    assert "goodput 1.00 req/s (40% of requests" in format_table(summary)
    assert "slo" not in summarize(results, duration=2.0)
