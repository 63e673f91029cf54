"""`kubesgl bench serving` refuses a numeric flag it cannot run with, as a usage error that
names the flag, before it asks the server anything."""

from __future__ import annotations

import pytest

from kubesgl.bench.serving import build_parser

BASE = ["--base-url", "http://127.0.0.1:20001"]  # nothing listens: the parser refuses first


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-concurrency", "-1"),  # asyncio.Semaphore(-1): ValueError
        ("--max-concurrency", "0"),  # taken as no limit before
        ("--random-range-ratio", "2"),  # randint(2 * len, len): empty range
        ("--random-range-ratio", "-0.5"),
        ("--random-range-ratio", "nan"),
        ("--random-input-len", "0"),  # randint(1, 0)
        ("--random-output-len", "0"),
        ("--prefix-groups", "0"),  # i % 0: ZeroDivisionError
        ("--num-prompts", "0"),
        ("--vocab-size", "10"),  # token ids are drawn in [10, vocab): none below 11
        ("--vocab-size", "many"),
        ("--request-rate", "nan"),  # ran as all at once, reported as rate nan
        ("--request-rate", "0"),
        ("--system-prompt-len", "-1"),  # [...] * -1: an empty prefix, silently
        ("--question-len", "0"),  # with --system-prompt-len 0, an empty prompt
        ("--question-len", "-1"),
        ("--max-context-len", "1"),  # max_len // 2: an empty prompt
        ("--max-context-len", "-4096"),
    ],
)
def test_a_bad_numeric_flag_is_a_usage_error_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*BASE, flag, value])
    assert exited.value.code == 2
    reason = capsys.readouterr().err.splitlines()[-1]
    assert reason.startswith(f"kubesgl bench serving: error: argument {flag}: "), reason


@pytest.mark.parametrize("bounds", [["0", "20"], ["1000", "-20"], ["nan", "20"]])
def test_a_goodput_bound_not_above_0_is_a_usage_error(bounds, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*BASE, "--goodput", *bounds])
    assert exited.value.code == 2
    reason = capsys.readouterr().err.splitlines()[-1]
    assert "error: argument --goodput: " in reason, reason


def test_the_edges_of_each_range_are_taken():
    args = build_parser().parse_args(
        [*BASE, "--max-concurrency", "1", "--random-range-ratio", "0", "--random-input-len", "1",
         "--random-output-len", "1", "--prefix-groups", "1", "--num-prompts", "1",
         "--vocab-size", "11", "--system-prompt-len", "0", "--question-len", "1",
         "--max-context-len", "2", "--goodput", "0.5", "inf"]
    )  # fmt: skip
    assert (args.max_concurrency, args.random_range_ratio, args.vocab_size) == (1, 0.0, 11)
    assert (args.system_prompt_len, args.question_len, args.max_context_len) == (0, 1, 2)
    assert args.goodput == [0.5, float("inf")]
    assert build_parser().parse_args([*BASE, "--random-range-ratio", "1"]).random_range_ratio == 1
