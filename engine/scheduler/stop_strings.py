"""Finds stop strings at the end of a request's output, by decoding only its tail."""

from __future__ import annotations

from functools import cached_property

from kubesgl.engine.scheduler.request import Req


class StopStringChecker:
    def __init__(self, model_path: str):
        self.model_path = model_path

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def match(self, req: Req) -> str | None:
        """The stop string that the newest token completed, if any."""
        stops = req.params.stop
        # Each token adds at least one byte: this many tokens cover the longest stop string,
        # plus a few for a multi-byte character cut at the start of the window.
        window = max(len(s.encode()) for s in stops) + 4
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=req.params.skip_special_tokens)
        # Checked after every token, so any match was completed by the newest one.
        return next((stop for stop in stops if stop in tail), None)
