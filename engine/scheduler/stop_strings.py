"""Finds stop strings in a request's output as it grows, reading each new character once."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property

from kubesgl.engine.scheduler.request import Req
from kubesgl.engine.tokenizer.detokenizer import DecodeState, IncrementalDetokenizer


@dataclass
class _Progress:
    """How far one request's output has been read."""

    text: DecodeState  # the incremental decoding, as the detokenizer does it
    tokens_read: int = 0


class StopStringChecker:
    def __init__(self, tokenizer):
        """`tokenizer`: the model's, which the engine loads (a model without one has no
        checker: its requests cannot have stop strings, Scheduler.validate)."""
        self.tokenizer = tokenizer
        # per request, and gone with it: a Req is hashed by identity
        self._progress: weakref.WeakKeyDictionary[Req, _Progress] = weakref.WeakKeyDictionary()

    @cached_property
    def _detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def match(self, req: Req) -> tuple[str, int] | None:
        """The stop string that the newest tokens completed, if any, and where it ends in the
        output text. Only the text they add is read: the tokens are decoded in a short window
        (as the detokenizer does, so both see the same text) and the stop strings are found by
        an automaton that carries its state from one call to the next. Before min_tokens the
        text is read without matching: no stop string counts there."""
        progress = self._progress.get(req)
        if progress is None:
            progress = self._progress[req] = _Progress(DecodeState.of(req.params))
        state = progress.text
        new_ids = req.output_ids[progress.tokens_read :]
        progress.tokens_read = len(req.output_ids)
        new_text = self._detokenizer.settle(state, new_ids, finished=False)
        if state.matcher is None or not new_text:
            return None
        if len(req.output_ids) < req.params.min_tokens:
            state.stop_state = state.matcher.advance(state.stop_state, new_text)
            return None
        state.stop_state, matched, read = state.matcher.find(state.stop_state, new_text)
        if matched is None:
            return None
        return matched, state.settled_chars - len(new_text) + read
