from __future__ import annotations

import pytest

from kubesgl.engine.tokenizer.detokenizer import DecodeState, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def stream(tokenizer, ids, stop=(), matched=None, chunk=1, include_stop=False, matched_token=None):
    detok = IncrementalDetokenizer(tokenizer)
    state = DecodeState(skip_special_tokens=True, stop=list(stop), include_stop=include_stop)
    pieces = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        pieces.append(
            detok.step(
                state,
                ids[i : i + chunk],
                finished=last,
                matched_stop=matched if last else None,
                matched_token=matched_token if last else None,
            )
        )
    return pieces


@pytest.mark.parametrize(
    "text", ["Hello world, this is kubesgl.", "東京 と 大阪 🙂 naïve café", "🙂🙂 résumé 東京"]
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # split characters are never shown half done


def test_multibyte_character_split_over_tokens(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # the byte-level tokenizer splits the emoji's four bytes
    pieces = stream(tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂"


def test_stop_string_never_leaks_and_is_cut(tokenizer):
    text = "The capital of France is Paris. The capital of Italy"
    ids = tokenizer.encode(text)
    stop = "Paris."
    cut_at = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    pieces = stream(tokenizer, ids[: cut_at + 1], stop=[stop, "never"], matched=stop)
    assert "".join(pieces) == "The capital of France is "
    for i in range(len(pieces)):
        assert not "".join(pieces[: i + 1]).endswith(("P", "Pa", "Par", "Pari", "Paris"))


def test_a_matched_stop_string_ends_the_text_when_asked(tokenizer):
    """vLLM's include_stop_str_in_output, SGLang's no_stop_trim."""
    text = "The capital of France is Paris. The capital of Italy"
    ids = tokenizer.encode(text)
    stop = "Paris."
    cut_at = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    pieces = stream(tokenizer, ids[: cut_at + 1], stop=[stop], matched=stop, include_stop=True)
    assert "".join(pieces) == "The capital of France is Paris."


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_matched_stop_token_adds_no_text(tokenizer, chunk):
    """A stop_token_ids token (or EOS) ends the answer without its text, as in vLLM, SGLang."""
    ids = tokenizer.encode("The capital of France is Paris", add_special_tokens=False)
    pieces = stream(tokenizer, ids, chunk=chunk, matched_token=ids[-1])
    assert "".join(pieces) == tokenizer.decode(ids[:-1]) == "The capital of France is"


def test_a_matched_stop_token_ends_the_text_when_asked(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris", add_special_tokens=False)
    pieces = stream(tokenizer, ids, matched_token=ids[-1], include_stop=True)
    assert "".join(pieces) == "The capital of France is Paris"


def test_partial_stop_string_is_released_when_it_does_not_complete(tokenizer):
    ids = tokenizer.encode("one two three")
    pieces = stream(tokenizer, ids, stop=["two four"])
    assert "".join(pieces) == "one two three"
