"""Stop strings are found in time linear in the new text (issue 11, item 4: 16 stop strings of
100 KB each held every other request for 9.5 s, the scheduler decoding and searching a window
as long as the longest stop string after every token). The checks count work, not time: the
tokens decoded and the characters the automaton reads at each step."""

from __future__ import annotations

import random

import pytest

from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.request import Req
from kubesgl.engine.scheduler.stop_strings import StopStringChecker
from kubesgl.engine.tokenizer import detokenizer
from kubesgl.engine.tokenizer.detokenizer import (
    MAX_PENDING_TOKENS,
    DecodeState,
    IncrementalDetokenizer,
    StopMatcher,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


class Counting:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, hf):
        self.hf, self.windows = hf, []

    def decode(self, ids, **kwargs):
        self.windows.append(len(ids))
        return self.hf.decode(ids, **kwargs)


@pytest.fixture
def reads(monkeypatch):
    """The characters the stop automaton reads, in order."""
    seen: list[str] = []
    step = StopMatcher._step

    def counted(self, state, char):
        seen.append(char)
        return step(self, state, char)

    monkeypatch.setattr(StopMatcher, "_step", counted)
    return seen


def naive_first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop) of the stop string that ends first in `text`, the longest of those that end there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def naive_held(text: str, stops: list[str]) -> int:
    return max(
        (n for s in stops for n in range(1, min(len(s), len(text)) + 1) if s.startswith(text[-n:])),
        default=0,
    )


@pytest.mark.parametrize("seed", range(30))
def test_the_automaton_finds_what_a_search_finds_reading_in_pieces(seed):
    rng = random.Random(seed)
    stops = [
        "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        for _ in range(rng.randint(1, 5))
    ]
    text = "".join(rng.choice("abc") for _ in range(60))
    matcher = StopMatcher(tuple(stops))
    state, read, found = 0, 0, None
    while read < len(text) and found is None:
        piece = text[read : read + rng.randint(1, 4)]
        state, matched, taken = matcher.find(state, piece)
        if matched is None:
            assert taken == len(piece)
            read += len(piece)
            assert matcher.held(state) == naive_held(text[:read], stops), (stops, text[:read])
        else:
            found, read = matched, read + taken
    expected = naive_first_match(text, stops)
    assert found == (expected[1] if expected else None), (stops, text)
    if found is not None:  # read up to the character that completed it
        assert text[:read].endswith(found) and naive_first_match(text[: read - 1], stops) is None


def test_held_text_is_the_longest_tail_that_begins_a_stop_string():
    matcher = StopMatcher(("abcd", "bc", "xyz"))
    assert matcher.held(matcher.advance(0, "zzab")) == 2
    assert (
        matcher.held(matcher.advance(0, "zzabc")) == 3
    )  # "abc" begins "abcd" (and ends with "bc")
    assert matcher.held(matcher.advance(0, "zzx")) == 1
    assert matcher.held(matcher.advance(0, "zzq")) == 0
    assert matcher.find(0, "zzabc") == (matcher.advance(0, "zzabc"), "bc", 5)


def test_the_automaton_of_the_longest_stop_strings_allowed_stays_small():
    import tracemalloc

    rng = random.Random(0)
    stops = tuple("".join(rng.choice("ab東") for _ in range(1024)) for _ in range(16))
    tracemalloc.start()
    try:
        matcher = StopMatcher(stops)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert matcher.size > 15 * 1024 and size < 1024 * 1024  # a dict per node took 5 MB


def _long_stops(count: int, length: int) -> list[str]:
    return [f"{i:02d}" + "q" * (length - 2) for i in range(count)]  # never in the output


def test_the_scheduler_reads_each_character_once_however_long_the_stop_strings(tokenizer, reads):
    output = tokenizer.encode(
        "The quick brown fox jumps over the lazy dog. " * 60
    )  # about 2,000 tokens
    counting = Counting(tokenizer)
    checker = StopStringChecker(counting)
    req = Req("r", [1, 2, 3], SamplingParams(stop=_long_stops(16, 5000), max_tokens=len(output)))
    for token in output:
        req.output_ids.append(token)
        assert checker.match(req) is None
    # each step decodes a short window: the work does not grow with the output nor with the stop strings
    # (a window as long as the longest stop string's bytes, as before, is the whole output here: 2 million
    # tokens decoded, and as many characters searched for each stop string)
    assert max(counting.windows) <= 2 * MAX_PENDING_TOKENS
    assert sum(counting.windows) <= 8 * len(output)
    # and the automaton reads every character once, never again
    assert "".join(reads) == tokenizer.decode(output)


def test_the_scheduler_finds_a_stop_string_as_the_detokenizer_cuts_it(tokenizer):
    text = "one two three four five six seven eight nine ten"
    output = tokenizer.encode(text)
    checker = StopStringChecker(tokenizer)
    req = Req("r", [1], SamplingParams(stop=["nine", "e fo"], max_tokens=100))
    for token in output:
        req.output_ids.append(token)
        if (found := checker.match(req)) is not None:
            break
    matched, end = found
    index = len(req.output_ids) - 1  # the token that completed it
    assert matched == "e fo" and "e fo" in tokenizer.decode(output[: index + 1])
    assert text[:end].endswith("e fo") and text.index("e fo") + len("e fo") == end
    assert "e fo" not in tokenizer.decode(output[:index])
    detok = IncrementalDetokenizer(tokenizer)
    state = DecodeState(skip_special_tokens=True, stop=["nine", "e fo"])
    pieces = [detok.step(state, [t], finished=False, matched_stop=None) for t in output[:index]]
    pieces.append(detok.step(state, [output[index]], finished=True, matched_stop=matched))
    assert "".join(pieces) == "one two thre"


def test_no_stop_string_counts_before_min_tokens(tokenizer):
    """A match before min_tokens is read past, and the rest of its token's text is still
    read (the matcher stopped at that match, missing one completed later in the same text);
    the text is cut where the counted match ends, not at an earlier occurrence."""
    text = "one two one two three"
    output = tokenizer.encode(text)
    stops = ["two", "thr"]
    first_two = next(i for i in range(len(output)) if "two" in tokenizer.decode(output[: i + 1]))
    checker = StopStringChecker(tokenizer)
    req = Req("r", [1], SamplingParams(stop=stops, max_tokens=100, min_tokens=first_two + 2))
    found = None
    for token in output:
        req.output_ids.append(token)
        if (found := checker.match(req)) is not None:
            break
    matched, end = found
    assert matched == "two" and end == text.rindex("two") + len("two")
    detok = IncrementalDetokenizer(tokenizer)
    for include in (False, True):
        state = DecodeState(skip_special_tokens=True, stop=stops, include_stop=include)
        index = len(req.output_ids) - 1
        pieces = [detok.step(state, [t], False, None) for t in output[:index]]
        pieces.append(detok.step(state, [output[index]], True, matched, end))
        whole = DecodeState(skip_special_tokens=True, stop=stops, include_stop=include)
        at_once = detok.step(whole, output[: index + 1], True, matched, end)  # LLM.generate's way
        expected = text[:end] if include else text[: end - len("two")]
        assert "".join(pieces) == at_once == expected


def test_the_detokenizer_reads_each_character_once_and_holds_back_no_more_than_a_stop_string(
    tokenizer, reads
):
    output = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)
    stops = _long_stops(16, 5000) + ["dog. The quick brown fox jumps over the lazy cat"]
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    state = DecodeState(skip_special_tokens=True, stop=stops)
    pieces = []
    for token in output:
        pieces.append(detok.step(state, [token], finished=False, matched_stop=None))
        assert len(state.held) <= len(stops[-1])
    pieces.append(detok.step(state, [], finished=True, matched_stop=None))
    text = tokenizer.decode(output)
    assert "".join(pieces) == text and "".join(reads) == text
    assert max(counting.windows) <= 2 * MAX_PENDING_TOKENS


def _tokens_without_text(tokenizer) -> dict[str, int]:
    """A token that is no UTF-8 on its own (a lone continuation byte), and one that decodes to
    nothing (a special token, skipped)."""
    vocab = tokenizer.get_vocab()
    lone_byte = next(
        i
        for i in sorted(vocab.values())
        if tokenizer.decode([i]) == detokenizer.REPLACEMENT_CHAR
        and tokenizer.decode([i, i]) == detokenizer.REPLACEMENT_CHAR * 2
    )
    return {
        "invalid bytes": lone_byte,
        "skipped special tokens": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


@pytest.mark.parametrize("kind", ["invalid bytes", "skipped special tokens"])
def test_output_that_never_settles_into_text_keeps_the_decoded_window_short(tokenizer, kind):
    """Text that keeps ending in U+FFFD waits for the rest of a character; a model can emit bytes
    that never complete one, and the window must not grow with them."""
    token = _tokens_without_text(tokenizer)[kind]
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    state = DecodeState(skip_special_tokens=True, stop=["zz"])
    for _ in range(600):
        detok.step(state, [token], finished=False, matched_stop=None)
    assert max(counting.windows) <= 2 * (MAX_PENDING_TOKENS + 1)

    counting = Counting(tokenizer)
    checker = StopStringChecker(counting)
    req = Req("r", [1], SamplingParams(stop=["zz"], max_tokens=1000))
    for _ in range(600):
        req.output_ids.append(token)
        checker.match(req)
    assert max(counting.windows) <= 2 * (MAX_PENDING_TOKENS + 1)


def test_a_character_split_over_tokens_still_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🙂🙂🙂 東京")
    detok = IncrementalDetokenizer(tokenizer)
    state = DecodeState(skip_special_tokens=True, stop=[])
    pieces = [
        detok.step(state, [t], finished=i == len(ids) - 1, matched_stop=None)
        for i, t in enumerate(ids)
    ]
    assert "".join(pieces) == "🙂🙂🙂 東京" and not any(
        detokenizer.REPLACEMENT_CHAR in p for p in pieces
    )


def test_the_checker_forgets_a_request_with_it(tokenizer):
    import gc

    checker = StopStringChecker(tokenizer)
    req = Req("r", [1], SamplingParams(stop=["zz"], max_tokens=10))
    req.output_ids.append(tokenizer.encode("a")[0])
    checker.match(req)
    assert len(checker._progress) == 1
    del req
    gc.collect()
    assert len(checker._progress) == 0
