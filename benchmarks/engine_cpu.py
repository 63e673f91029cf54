"""CPU benchmark of the engine core (issue: engine core).

1. The scheduler's own cost per decode step, with the forward pass replaced by a no-op
   that returns fixed tokens, at batch 1, 64 and 256 (overlap on and off).
2. Output tokens/s of the engine against transformers' `generate` on the same tiny model
   and the same batch (greedy, fixed output length).

    python benchmarks/engine_cpu.py --out benchmarks/results/engine_cpu.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch
from common import report

from kubesgl.engine import LLM, SamplingParams
from kubesgl.engine.executor.model_runner import PendingStep
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.models.tiny import make_tiny_model


def scheduler_cost(model: str, batch: int, overlap: bool, steps: int = 200) -> dict:
    llm = LLM(
        model,
        device="cpu",
        dtype="float32",
        max_running_requests=batch,
        max_total_tokens=batch * 600,
        disable_overlap_schedule=not overlap,
    )
    engine = llm.engine
    runner = engine.executor.runner
    runner.run = lambda fb: PendingStep(
        {"token_ids": torch.full((fb.batch_size,), 7)}, None
    )  # no forward pass
    for i in range(batch):
        engine.add_request(
            GenerateRequest(
                f"r{i}", [5] * 32, SamplingParams(max_tokens=steps + 50, ignore_eos=True)
            )
        )
    while any(r.status.name != "DECODING" for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(10):  # warm up
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    llm.shutdown()
    return {
        "batch": batch,
        "overlap": overlap,
        "us_per_step_median": statistics.median(times) * 1e6,
        "us_per_step_p90": sorted(times)[int(0.9 * len(times))] * 1e6,
    }


def throughput(model: str, batch: int, input_len: int, output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = [[(i * 31 + j * 7) % 500 + 3 for j in range(input_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    with LLM(model, device="cpu", dtype="float32", max_running_requests=batch) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        engine_s = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outputs)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        hf.generate(ids[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
        hf_s = time.perf_counter() - start
    assert out.shape[1] == input_len + output_len
    tokens = batch * output_len
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "engine_tokens_per_s": tokens / engine_s,
        "transformers_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / engine_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/engine_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "llama"))
        results = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            "scheduler_cost": [
                scheduler_cost(model, b, o) for b in (1, 64, 256) for o in (False, True)
            ],
            "throughput": [throughput(model, b, 128, 128) for b in (1, 16)],
        }
    report(results, args.out)


if __name__ == "__main__":
    main()
