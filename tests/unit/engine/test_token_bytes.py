"""Log-probability `bytes`: the raw bytes of each token, also where a token holds part of a
UTF-8 character (its text alone would be U+FFFD)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kubesgl.engine.tokenizer.token_bytes import TokenBytes

TEXT = "жé 東京 🙂 naïve café, Zürich"


def test_byte_level_bpe_tokens_concatenate_to_the_text(tiny_model):
    hf = AutoTokenizer.from_pretrained(tiny_model("llama"))
    token_bytes = TokenBytes(hf)
    ids = hf.encode(TEXT, add_special_tokens=False)
    pieces = [token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert pieces[:2] == [
        b"\xd0",
        b"\xb6",
    ]  # "ж" is in none of the tiny vocabulary's merges: two byte tokens


def test_every_byte_level_token_has_its_vocabulary_bytes(tiny_model):
    hf = AutoTokenizer.from_pretrained(tiny_model("llama"))
    token_bytes = TokenBytes(hf)
    for token_id in range(len(hf)):
        if token_id in hf.all_special_ids:
            assert token_bytes(token_id) == hf.decode([token_id]).encode()
            continue
        raw = token_bytes(token_id)
        try:
            assert raw.decode() == hf.decode([token_id])  # whole characters: the text's own bytes
        except UnicodeDecodeError:
            assert "\ufffd" in hf.decode([token_id])  # part of a character: the text cannot say


@pytest.fixture
def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: ▁ for spaces, <0xNN> byte-fallback pieces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁caf": 4, "é": 5, "a": 6, "▁a": 7}
    vocab.update({f"<0x{b:02X}>": 8 + b for b in range(256)})
    model = models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_sentencepiece_byte_fallback_and_spaces(sentencepiece_tokenizer):
    hf = sentencepiece_tokenizer
    token_bytes = TokenBytes(hf)
    assert token_bytes(4) == b" caf"
    assert token_bytes(5) == "é".encode()
    assert token_bytes(8 + 0xE6) == b"\xe6"  # one byte of a character the vocabulary lacks
    ids = hf.encode(" a 東", add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids).endswith("東".encode())


def test_the_api_reports_raw_bytes_of_a_partial_character():
    from kubesgl.engine.messages import TextOutput, TokenLogprob
    from kubesgl.engine.server.openai_format import logprob_entries

    out = TextOutput(
        rid="r",
        text="",
        token_ids=[143],
        finish_reason=None,
        prompt_tokens=1,
        cached_tokens=0,
        completion_tokens=1,
        logprobs=[TokenLogprob(143, -0.5, [(143, -0.5), (9, -1.0)])],
        token_strings=["\ufffd"],
        top_strings=[["\ufffd", "a"]],
        token_bytes=[[0xD0]],
        top_bytes=[[[0xD0], [0x61]]],
    )
    [entry] = logprob_entries(out)
    assert entry["bytes"] == [0xD0] and [t["bytes"] for t in entry["top_logprobs"]] == [
        [0xD0],
        [0x61],
    ]
