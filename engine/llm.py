"""Offline generation: `LLM(model=PATH, **engine options).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kubesgl.engine.config import ENGINE_OPTIONS, OFFLINE_REFUSED, EngineConfig
from kubesgl.engine.messages import FinishReason, GenerateRequest, TokenLogprob
from kubesgl.engine.preflight import check_engine
from kubesgl.engine.sampling_params import (
    SGLANG_GRAMMAR_FIELDS,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
    is_utf8,
)
from kubesgl.engine.scheduler.engine import Engine
from kubesgl.engine.tokenizer.detokenizer import DecodeState, IncrementalDetokenizer

logger = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass
class RequestOutput:
    """One prompt's result. Its ending in plain values, as vLLM's outputs give it."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # the stop string, or stop_token_ids entry, that ended it (None: EOS, length, ...), as vLLM's
    stop_reason: int | str | None = None
    finish_message: str | None = None  # why an aborted or refused request ended
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


Prompt = str | Sequence[int]
Params = SamplingParams | dict[str, Any] | None


def _is_prompt(prompt: object) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt)
    )


def _prompt_list(prompts: object) -> list[Prompt]:
    # a string or a list of ints is one prompt: neither can be a list of prompts
    if isinstance(prompts, str) or (prompts and _is_prompt(prompts)):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a string or a list of token ids, or a list of those; got {prompts!r:.80}"
        )
    for i, prompt in enumerate(prompts):
        if not _is_prompt(prompt):
            raise TypeError(
                f"prompt {i} must be a string or a list of token ids, got {prompt!r:.80}"
            )
    return list(prompts)


def _params_list(params: object, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams | dict):
        params = [params] * count
    if not isinstance(params, Sequence):
        raise TypeError(
            f"sampling params must be a SamplingParams or a dict, or a list of those; got {params!r:.80}"
        )
    if len(params) != count:
        raise ValueError(f"{count} prompts but {len(params)} sampling params")
    return [_params(p) for p in params]


# SGLang's Engine.generate names, taken as they are, so that its scripts run unchanged
_SGLANG_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
}


def _from_sglang_names(options: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(options) - known - set(_SGLANG_NAMES) - set(SGLANG_GRAMMAR_FIELDS))
    if unknown:
        raise TypeError(
            f"unknown sampling options {unknown}; known: {sorted(known)}, and SGLang's "
            f"{sorted([*_SGLANG_NAMES, *SGLANG_GRAMMAR_FIELDS])}"
        )
    for alias, name in _SGLANG_NAMES.items():
        if alias in options and name in options:
            raise TypeError(f"give {name} or SGLang's {alias}, not both")
    renamed = {_SGLANG_NAMES.get(name, name): value for name, value in options.items()}
    grammars = [kind for kind in SGLANG_GRAMMAR_FIELDS if kind in renamed]
    if len(grammars) + ("grammar" in renamed) > 1:
        raise TypeError(f"give at most one output constraint, got {grammars}")
    for kind in grammars:
        renamed["grammar"] = GrammarSpec(kind, renamed.pop(kind), param=kind)
    return renamed


def _params(params: object) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams(**_from_sglang_names(params))
    raise TypeError(f"sampling params must be a SamplingParams or a dict, got {params!r:.80}")


def _refuse_served_options(config: EngineConfig) -> None:
    for name, reason in OFFLINE_REFUSED.items():
        value = getattr(config, name)
        if value != ENGINE_OPTIONS[name].default:
            raise ValueError(f"{name} {value!r}: {reason}")


class LLM:
    def __init__(self, model: str, **options):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; known: {sorted(known - {'model'})}")
        config = EngineConfig(model=model, **options)
        _refuse_served_options(config)
        # A mistake in one line (a StartupError) before any weight is read; a Hugging Face id
        # becomes the folder of its snapshot in the Hub's cache.
        config = check_engine(config)
        self.engine = Engine(config)

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded with the engine; None for a directory without one
        (token ids only)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Params | Sequence[Params] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the results in prompt order. A prompt is a
        string or a list of token ids; one prompt may be given alone. Sampling options are a
        SamplingParams or a dict of its fields, one for all prompts or one each. Raises
        InvalidRequestError, naming the problem, before anything runs if any request is
        invalid."""
        prompt_list = _prompt_list(prompts)
        params_list = _params_list(params, len(prompt_list))
        requests = [
            GenerateRequest(rid=f"llm-{next(_ids)}", input_ids=self._token_ids(prompt), params=p)
            for prompt, p in zip(prompt_list, params_list)
        ]
        for request in requests:
            self.engine.validate(request)
        results = {r.rid: RequestOutput(prompt_token_ids=r.input_ids) for r in requests}
        reasons: dict[str, FinishReason] = {}
        pending = set(results)
        try:
            for request in requests:
                self.engine.add_request(request)
            self._run(results, reasons, pending)
        except BaseException:  # Ctrl-C, or a step that failed: the next call starts clean
            self._abandon(pending)
            raise
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer)
            for request in requests:
                # the same text a server client receives: cut at a matched stop string
                result = results[request.rid]
                state = DecodeState.of(request.params)
                reason = reasons.get(request.rid)
                result.text = detokenizer.step(
                    state,
                    result.token_ids,
                    finished=True,
                    matched_stop=reason.matched_str if reason else None,
                    matched_end=reason.matched_end if reason else None,
                    matched_token=reason.matched_token if reason else None,
                )
        return [results[r.rid] for r in requests]

    def _run(
        self,
        results: dict[str, RequestOutput],
        reasons: dict[str, FinishReason],
        pending: set[str],
    ) -> None:
        while pending:
            for out in self.engine.step():
                result = results.get(out.rid)
                if result is None:  # the end of a request of an earlier, interrupted call
                    continue
                result.token_ids += out.token_ids
                result.cached_tokens = out.cached_tokens
                if out.logprobs:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.finished:
                    assert out.finish_reason is not None  # a finished output says why
                    reason = reasons[out.rid] = out.finish_reason
                    result.finish_reason, result.finish_message = reason.kind, reason.message
                    result.stop_reason = reason.stop_reason
                    pending.discard(out.rid)

    def _abandon(self, rids: set[str]) -> None:
        """End the requests of an interrupted call and let go of what they hold."""
        for rid in rids:
            self.engine.abort_request(rid, "the generate call was interrupted")
        try:
            self.engine.scheduler.drain()
        except Exception:
            # The step in flight may be the one that failed: its error is already on its way
            # to the caller, and a second raise here would hide it.
            logger.debug("finishing an interrupted call's step in flight failed", exc_info=True)

    def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: give prompts as token ids", param="prompt"
                )
            if not is_utf8(prompt):
                raise InvalidRequestError(
                    "the prompt is not valid UTF-8 text (a lone surrogate is not)", param="prompt"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
