"""Structured output: what grammar masks cost per decode step, and throughput with half of the
requests constrained to a JSON schema against none.

    python benchmarks/structured_output.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --out benchmarks/results/structured_output_h200.json

Per-step cost, for batches of 1 and 64 whose every row has a grammar: filling the bitmask from
the matchers on the CPU (the scheduler's part; with overlap it runs while the step's forward
pass does), and applying it to the logits on the device (the sampler's part, on the critical
path). Then end to end: the same requests with 0 % and 50 % constrained, output tokens/s.

A model folder without a tokenizer (the config-only 8B shape) gets a synthetic byte-level one
of the model's vocabulary size: random lower-case pieces with and without a leading space, the
256 bytes and the special tokens. Its masks are as wide as a real one's, and JSON's string
rules see printable tokens as a real vocabulary's mostly are; a real tokenizer (--tokenizer-from)
gives the exact figure.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import xgrammar
from common import engine_facts, engine_parser, make_llm, report

from kubesgl.engine import SamplingParams
from kubesgl.engine.sampling_params import GrammarSpec
from kubesgl.engine.scheduler.grammar import json_grammar
from kubesgl.engine.tokenizer.loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "score", "kind"],
                "properties": {
                    "name": {"type": "string"},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                },
            },
        }
    },
}


def synthetic_tokenizer_dir(model: Path, out: Path, vocab_size: int) -> Path:
    """`model`'s config with a byte-level tokenizer of `vocab_size` tokens (see the docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    vocab: dict[str, int] = {}
    for piece in sorted(alphabet):
        vocab[piece] = len(vocab)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size - len(specials):
        piece = ("Ġ" if rng.random() < 0.5 else "") + "".join(
            rng.choices(letters, k=rng.randint(2, 9))
        )
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    shutil.copy(model / "config.json", out / "config.json")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=specials[0], eos_token=specials[2]
    ).save_pretrained(out)
    return out


def mask_step_costs(
    tokenizer, vocab_size: int, eos: list[int], batch: int, steps: int, device: torch.device
) -> dict:
    """Median microseconds per step to fill `batch` rows' bitmasks and to apply them to logits."""
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos
    )
    compiler = xgrammar.GrammarCompiler(info)
    start = time.perf_counter()
    compiled = compiler.compile_grammar(json_grammar(json.dumps(SCHEMA)))  # the engine's
    compile_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch, vocab_size, device=device)
    bits = torch.arange(32, dtype=torch.int32)
    walk = torch.Generator().manual_seed(0)
    fill_us, apply_us = [], []
    for _ in range(steps):
        t = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        fill_us.append((time.perf_counter() - t) * 1e6)
        work = logits.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(work, bitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize()
        apply_us.append((time.perf_counter() - t) * 1e6)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab_size].float()
        allowed[:, eos] = 0
        for row, matcher in enumerate(
            matchers
        ):  # a random walk through the grammar, restarted at its end
            weights = allowed[row]
            token = int(torch.multinomial(weights, 1, generator=walk)) if weights.any() else eos[0]
            if not matcher.accept_token(token) or matcher.is_terminated():
                matcher.reset()
    return {
        "batch": batch,
        "steps": steps,
        "compile_seconds": compile_s,
        "fill_us_median": statistics.median(fill_us),
        "apply_us_median": statistics.median(apply_us),
    }


def throughput(llm, prompts: list[list[int]], output_len: int, constrained_share: float) -> dict:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    constrained = int(len(prompts) * constrained_share)
    params = [
        SamplingParams(
            max_tokens=output_len,
            temperature=0,
            ignore_eos=True,
            grammar=grammar if i < constrained else None,
        )
        for i in range(len(prompts))
    ]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "constrained_share": constrained_share,
        "requests": len(prompts),
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "constrained_mean_tokens": statistics.mean(len(o.token_ids) for o in outputs[:constrained])
        if constrained
        else None,
        "finish_reasons": sorted({str(o.finish_reason) for o in outputs}),
    }


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16")
    parser.add_argument(
        "--tokenizer-from", default=None, help="a folder with a real tokenizer for this vocabulary"
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="kubesgl-structured-"))
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    source = args.tokenizer_from or (str(model) if load_tokenizer(str(model), warn=False) else None)
    if source is None:
        synthetic_tokenizer_dir(model, workdir, vocab_size)
        for item in model.iterdir():  # the weights, if any, beside the synthetic tokenizer
            if not (workdir / item.name).exists():
                (workdir / item.name).symlink_to(item.resolve())
        args.model = str(workdir)
    elif args.tokenizer_from:
        shutil.copytree(model, workdir, dirs_exist_ok=True, symlinks=True)
        load_tokenizer(args.tokenizer_from).save_pretrained(workdir)
        args.model = str(workdir)
    llm = make_llm(args, context_length=args.input_len + args.output_len + 16)
    tokenizer = llm.tokenizer
    eos = sorted(llm.engine.model_config.eos_token_ids)
    device = llm.engine.executor.runner.device
    masks = []
    for batch in (1, 64):
        masks.append(mask_step_costs(tokenizer, vocab_size, eos, batch, args.mask_steps, device))
        print(f"mask costs at batch {batch}: {masks[-1]}", flush=True)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, vocab_size - 10) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    runs = [throughput(llm, prompts, args.output_len, share) for share in (0.0, 0.5)]
    result = {
        **engine_facts(args, llm),
        "tokenizer": args.tokenizer_from or ("synthetic" if source is None else "model's"),
        "vocab_size": vocab_size,
        "overlap": not args.disable_overlap_schedule,
        "schema": SCHEMA,
        "mask_step_costs": masks,
        "throughput": runs,
        "throughput_ratio_50pct_vs_none": runs[1]["output_tokens_per_s"]
        / runs[0]["output_tokens_per_s"],
    }
    llm.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
    report(result, args.out)


if __name__ == "__main__":
    main()
