"""The raw bytes of one token, for the `bytes` of OpenAI log-probabilities. A token's text
cannot give them: a token may hold part of a UTF-8 character, and decoding it alone yields
U+FFFD. The vocabulary's own spelling of the token can:

- byte-level BPE (GPT-2, Llama 3, Qwen): each character of the token stands for one byte;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xNN>` is byte NN, `▁` a space.

Special tokens and other vocabularies fall back to the UTF-8 of the decoded text.
"""

from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.special_ids = set(hf_tokenizer.all_special_ids)
        self.byte_of = None
        self.sentencepiece = False
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        decoder = (
            json.loads(backend.to_str()).get("decoder") if backend is not None else None
        ) or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if "ByteLevel" in kinds:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self.sentencepiece = "ByteFallback" in kinds or "Metaspace" in kinds

    def __call__(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if token_id in self.special_ids or piece is None:
            return self.hf.decode([token_id]).encode()
        if self.byte_of is not None and all(char in self.byte_of for char in piece):
            return bytes(self.byte_of[char] for char in piece)
        if self.sentencepiece:
            if match := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(match[1], 16)])
            return piece.replace("\u2581", " ").encode()
        return self.hf.decode([token_id]).encode()
