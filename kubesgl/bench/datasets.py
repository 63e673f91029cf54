"""Request sets for `kubesgl bench serving`, made on the spot (nothing is downloaded).

- random: prompt and output lengths drawn uniformly in [ratio * len, len];
- shared-prefix: a few long system prompts, each followed by many different questions;
- sharegpt: conversation-like lengths, log-normal around ShareGPT's medians (prompts of a
  few hundred tokens, answers of a couple of hundred, long tails), clipped to the context.
Prompts are token ids, so their lengths are exact whatever the tokenizer.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Prompt token ids are drawn from here up to the vocabulary size: the lowest ids are often
# special tokens (padding, begin and end of sequence).
FIRST_TOKEN_ID = 10


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


def random_requests(
    count: int, input_len: int, output_len: int, range_ratio: float, vocab: int, rng: random.Random
) -> list[BenchRequest]:
    def length(n: int) -> int:
        return rng.randint(max(1, int(n * range_ratio)), n)

    return [
        BenchRequest(
            [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length(input_len))],
            length(output_len),
        )
        for _ in range(count)
    ]


def shared_prefix_requests(
    count: int,
    groups: int,
    system_len: int,
    question_len: int,
    output_len: int,
    vocab: int,
    rng: random.Random,
) -> list[BenchRequest]:
    systems = [
        [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(system_len)] for _ in range(groups)
    ]
    requests = [
        BenchRequest(
            systems[i % groups]
            + [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(question_len)],
            output_len,
        )
        for i in range(count)
    ]
    rng.shuffle(requests)
    return requests


def sharegpt_like_requests(
    count: int, max_len: int, vocab: int, rng: random.Random
) -> list[BenchRequest]:
    def lognormal(median: float, sigma: float) -> int:
        return max(4, int(math.exp(rng.gauss(math.log(median), sigma))))

    out = []
    for _ in range(count):
        prompt_len = min(lognormal(220, 1.0), max_len // 2)
        output_len = min(lognormal(180, 0.9), max_len - prompt_len)
        out.append(
            BenchRequest(
                [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(prompt_len)], output_len
            )
        )
    return out
