"""Messages between the engine's layers: what enters the scheduler and what leaves it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubesgl.engine.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched_token: int | None = None  # the stop or EOS token that ended the request
    message: str | None = None  # why an aborted request ended

    def __str__(self) -> str:
        return self.kind


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenOutput:
    """New tokens of one request from one scheduler step."""

    rid: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
