"""Batch decode latency against the memory roofline (weights bytes / device copy bandwidth).

Runs the offline engine on a model directory (`--load-format dummy` needs only its
config.json) and reports milliseconds per decode step at the given batch, measured from
the decode phase alone (total time minus the time to the first token), next to the
roofline measured in the same run.

    python benchmarks/decode_latency.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --batch 1 --input-len 128 --output-len 512 --out benchmarks/results/decode_latency.json
"""

from __future__ import annotations

import time

import torch
from common import engine_facts, engine_parser, make_llm, report

from kubesgl.engine import SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times)[len(times) // 2]


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="torch")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    llm = make_llm(
        args,
        max_running_requests=max(args.batch, 1),
        context_length=args.input_len + args.output_len + 16,
    )
    device = llm.engine.device
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [(i * 131 + j * 17) % (vocab - 10) + 5 for j in range(args.input_len)]
        for i in range(args.batch)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm up

    def timed(max_tokens: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return time.perf_counter() - start

    first_token_s = min(timed(1) for _ in range(3))
    total_s = timed(args.output_len)
    ms_per_step = (total_s - first_token_s) / (args.output_len - 1) * 1e3
    result = {
        **engine_facts(args, llm),
        "device": str(device),
        "kv_cache_dtype": args.kv_cache_dtype,
        "overlap": not args.disable_overlap_schedule,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "first_token_ms": first_token_s * 1e3,
        "ms_per_decode_step": ms_per_step,
        "output_tokens_per_s": args.batch * args.output_len / total_s,
        "weight_bytes": weight_bytes,
    }
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        result["copy_bandwidth_tb_s"] = bandwidth / 1e12
        result["roofline_ms_per_step"] = weight_bytes / bandwidth * 1e3
        result["ratio_to_roofline"] = ms_per_step / result["roofline_ms_per_step"]
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
