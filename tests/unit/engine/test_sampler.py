from __future__ import annotations

import pytest
import torch

from kubesgl.engine import InvalidRequestError, SamplingParams
from kubesgl.engine.executor.sampler import PenaltyState, top_k_top_p_min_p_mask


def reference_support(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The definitions, written out token by token."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank >= top_k or mass >= top_p or probs[i] < min_p * probs[order[0]]:
            continue
        keep.add(i)
        mass += probs[i]
    return keep | {order[0]}


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(3, 1.0, 0.0), (100, 0.5, 0.0), (100, 1.0, 0.2), (4, 0.7, 0.05), (1, 1.0, 0.0)],
)
def test_mask_matches_definitions(top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 12, generator=generator) * 2, dim=-1)
    mask = top_k_top_p_min_p_mask(
        probs, torch.full((5,), top_k), torch.full((5,), top_p), torch.full((5,), min_p)
    )
    for row in range(5):
        expected = reference_support(probs[row].tolist(), top_k, top_p, min_p)
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == expected


@pytest.fixture(scope="module")
def llm(tiny_model, assert_pool_clean):
    from kubesgl.engine import LLM

    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", max_total_tokens=8192)
    yield llm
    assert_pool_clean(llm)
    llm.shutdown()


def next_token_probs(model_path, prompt, temperature):
    """The model's next-token distribution, computed by transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return torch.softmax(logits / temperature, dim=-1)


def test_seeded_sampling_is_reproducible(llm):
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=30, temperature=1.5, seed=1234, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    again = llm.generate([prompt], params)[0].token_ids
    other = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=1.5, seed=99, ignore_eos=True)
    )[0].token_ids
    assert first == again
    assert first != other
    # the seed's draws do not depend on what else is in the batch
    batch = llm.generate(
        [prompt, [9, 9, 9], prompt],
        [params, SamplingParams(max_tokens=30, temperature=1.0), params],
    )
    assert batch[0].token_ids == first and batch[2].token_ids == first


@pytest.mark.parametrize("option", [{"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.3}])
def test_sampled_tokens_stay_in_the_allowed_support(llm, tiny_model, option):
    prompt, temperature = [11, 12, 13], 0.7
    probs = next_token_probs(tiny_model("llama"), prompt, temperature)
    allowed = reference_support(
        probs.tolist(),
        option.get("top_k", 10**6),
        option.get("top_p", 1.0),
        option.get("min_p", 0.0),
    )
    params = [
        SamplingParams(max_tokens=1, temperature=temperature, seed=s, **option) for s in range(200)
    ]
    seen = {o.token_ids[0] for o in llm.generate([prompt] * 200, params)}
    assert seen <= allowed
    assert len(seen) >= min(2, len(allowed))
    unrestricted = {
        o.token_ids[0]
        for o in llm.generate(
            [prompt] * 200,
            [SamplingParams(max_tokens=1, temperature=temperature, seed=s) for s in range(200)],
        )
    }
    assert not unrestricted <= allowed  # the option really cut something away


def test_penalties_change_greedy_output_as_defined(llm):
    prompt = [20, 21, 22, 23]
    plain = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    no_repeats = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=40,
            temperature=0,
            ignore_eos=True,
            presence_penalty=2.0,
            repetition_penalty=100.0,
        ),
    )[0].token_ids
    assert len(set(no_repeats)) == len(no_repeats)  # every seen token is pushed far down
    assert not set(no_repeats) & set(prompt)  # repetition penalty covers the prompt too
    freq = llm.generate(
        [prompt],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=0.5),
    )[0].token_ids
    assert freq != plain


def test_huge_top_k_and_tiny_temperature_are_harmless(llm):
    """top_k beyond the vocabulary means no cut (it once overflowed the int64 batch tensor
    and killed the scheduler); a temperature near zero is greedy (it once gave NaNs)."""
    prompt = [5, 6, 7]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    huge = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, top_k=2**64, ignore_eos=True)
    )
    tiny = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True))
    assert huge[0].token_ids == greedy and tiny[0].token_ids == greedy
    sampled = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=1.0, top_k=2**63, seed=1)
    )
    assert len(sampled[0].token_ids) == 8


def test_penalty_counts_take_only_the_rows_that_emit():
    """A mixed step samples a token for every row, but a prompt chunk that does not end its
    prompt emits nothing: its token must not count (record writes every row, adding 0 there)."""
    state = PenaltyState(num_rows=4, vocab_size=10, device=torch.device("cpu"))
    state.reset([(1, [2, 3], [7, 7]), (2, [4], [])])
    rows, tokens = torch.tensor([1, 2, 3]), torch.tensor([7, 5, 6])
    state.record(rows, tokens, emits=torch.tensor([True, False, True]))
    counts, seen = state._ensure()
    assert counts[1].tolist() == [0] * 7 + [3, 0, 0]
    assert counts[2].sum() == 0 and counts[3].tolist() == [0] * 6 + [1, 0, 0, 0]
    assert seen[1].nonzero().flatten().tolist() == [2, 3, 7]
    assert seen[2].nonzero().flatten().tolist() == [4]
    assert seen[3].nonzero().flatten().tolist() == [6]


def test_logit_bias_moves_tokens_as_openai_defines_it(llm):
    """+100 all but forces a token and -100 bans one in effect, in one batch with a request
    that asked for no bias; the reported logprobs stay the model's own."""
    prompt = [20, 21, 22, 23]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    plain = llm.generate([prompt], greedy)[0]
    forced, banned, unbiased = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=8, temperature=1.0, seed=1, logit_bias={7: 100}),
            SamplingParams(
                max_tokens=8,
                temperature=0,
                ignore_eos=True,
                logit_bias={t: -100 for t in set(plain.token_ids)},
            ),
            greedy,
        ],
    )
    assert forced.token_ids == [7] * 8
    assert not set(banned.token_ids) & set(plain.token_ids)
    assert unbiased.token_ids == plain.token_ids
    biased_first = llm.generate(
        [prompt],
        SamplingParams(max_tokens=1, temperature=0, logprobs=0, logit_bias={7: 100}),
    )[0]
    assert biased_first.token_ids == [7]
    assert biased_first.logprobs[0].logprob < -1  # the model's own, not the biased one


@pytest.mark.parametrize(
    "bias, words",
    [
        ({10_000: 1}, "outside the vocabulary"),
        ({-1: 1}, "outside the vocabulary"),
        ({7: 101}, "from -100 to 100"),
        ({7: "1"}, "from -100 to 100"),
        (dict.fromkeys(range(1025), 1.0), "at most 1024 tokens"),
    ],
)
def test_a_logit_bias_out_of_bounds_is_refused(bias, words):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(logit_bias=bias).validate(vocab_size=2048)
    assert refused.value.param == "logit_bias" and words in str(refused.value)
