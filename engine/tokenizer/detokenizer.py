"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens and taking what the newest tokens
added, so each step costs the same however long the output is. Two things are held back
until they are settled: text ending in an incomplete UTF-8 character (a multi-byte
character split over tokens decodes to U+FFFD until its last byte arrives), and a tail that
could be the start of a stop string, so that no part of a stop string ever reaches a
client. When the request ends on a stop string, the text is cut where it begins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeState:
    skip_special_tokens: bool
    stop: list[str]
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens before this were turned into text
    text: str = ""  # all settled text, including what is held back for stop strings
    sent: int = 0  # characters of `text` already handed out


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int], state: DecodeState) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=state.skip_special_tokens)

    def step(self, state: DecodeState, new_ids: list[int], finished: bool, matched_stop: str | None) -> str:
        """Add tokens; returns the text that may now be sent."""
        state.token_ids += new_ids
        window = state.token_ids[state.prefix_offset :]
        before = self._decode(state.token_ids[state.prefix_offset : state.read_offset], state)
        full = self._decode(window, state)
        if full.endswith(REPLACEMENT_CHAR) and not finished:
            pass  # the newest tokens end inside a character: wait for the rest
        elif len(full) > len(before):
            state.text += full[len(before) :]
            state.prefix_offset, state.read_offset = state.read_offset, len(state.token_ids)
        elif finished:
            state.read_offset = len(state.token_ids)
        return self._release(state, finished, matched_stop)

    def _release(self, state: DecodeState, finished: bool, matched_stop: str | None) -> str:
        end = len(state.text)
        if matched_stop is not None:
            cut = state.text.find(matched_stop, max(0, state.sent - len(matched_stop)))
            if cut >= 0:
                end = cut
        elif not finished:
            end -= _partial_stop_len(state.text, state.stop)
        end = max(end, state.sent)
        out = state.text[state.sent : end]
        state.sent = end
        return out


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a prefix of (or equal to) a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop), len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest
