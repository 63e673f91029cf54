"""Offline generation: `LLM(model=PATH, **engine options).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.engine import Engine
from kubesgl.engine.io import FinishReason, GenerateRequest, TokenLogprob
from kubesgl.engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class LLM:
    def __init__(self, model: str, **options):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known - {'model'})}")
        self.engine = Engine(EngineConfig(model=model, **options))
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.config.model)
        return self._tokenizer

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings, or lists of token ids) and return the results
        in prompt order. Raises InvalidRequestError, naming the problem, before anything runs
        if any request is invalid."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [
            GenerateRequest(rid=f"llm-{next(_ids)}", input_ids=self._token_ids(prompt), params=p)
            for prompt, p in zip(prompts, params)
        ]
        for request in requests:
            self.engine.validate(request)
        results = {r.rid: RequestOutput(prompt_token_ids=r.input_ids) for r in requests}
        for request in requests:
            self.engine.add_request(request)
        pending = set(results)
        while pending:
            for out in self.engine.step():
                result = results[out.rid]
                result.token_ids += out.token_ids
                result.cached_tokens = out.cached_tokens
                if out.logprobs:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
                    pending.discard(out.rid)
        for request in requests:
            result = results[request.rid]
            if isinstance(prompts[0], str) or self._tokenizer is not None:
                result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=request.params.skip_special_tokens)
        return [results[r.rid] for r in requests]

    def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
