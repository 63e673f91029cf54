"""Messages between the engine's processes and layers: what enters the scheduler and what
leaves it, and what the tokenizer, detokenizer and API server pass along."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kubesgl import contract
from kubesgl.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BootstrapTarget:
    """A request's prefill/decode pairing as the router gave it: where its KV comes from
    (decode side) or which room it fills (prefill side)."""

    room: int
    host: str | None  # the prefill engine's bootstrap host (needed by the decode side only)
    port: int  # its bootstrap port

    @property
    def address(self) -> str:
        assert self.host is not None, "only a decode engine reaches the bootstrap server"
        return contract.http_url(self.host, self.port)


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    # The n copies of one prompt name their first copy here: they wait until its prompt is
    # in the prefix cache, then share it instead of computing it n times.
    prefix_leader: str | None = None
    bootstrap: BootstrapTarget | None = None  # prefill/decode: the room this request fills or reads
    # The first sequence of the client request this one is part of (its prompts times n),
    # None for that first one: a request is queued or refused whole (--max-queued-requests)
    request_leader: str | None = None
    # a health check (/health_generate): a busy engine, its queue full, is still healthy
    probe: bool = False


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted"


# How a request ended: "stop" (a stop string or token, or EOS), "length" (its token budget),
# "abort" (cut short before either: `message` says why), "error" (refused or failed: `message`
# and `status` say how)
FinishKind = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    matched_token: int | None = None  # the stop or EOS token that ended the request
    stop_token: bool = False  # matched_token is one of the request's stop_token_ids
    matched_str: str | None = None  # the stop string that ended the request
    matched_end: int | None = None  # where it ends in the output text (characters)
    message: str | None = None  # why an aborted request ended, or what was wrong with it
    param: str | None = None  # for "error": the request field at fault
    status: int = 400  # for "error": the HTTP status to answer with (5xx: this server failed)
    code: str | None = None  # for "error": OpenAI's error code, where it has one

    def __str__(self) -> str:
        return self.kind

    @property
    def matched(self) -> int | str | None:
        """SGLang's `matched`: the stop string, or the stop or EOS token, that ended the request."""
        return self.matched_str if self.matched_str is not None else self.matched_token

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's `stop_reason`: the stop string, or the stop_token_ids entry, that ended the
        request; None for any other ending, EOS (or a grammar's end) included."""
        if self.matched_str is not None:
            return self.matched_str
        return self.matched_token if self.stop_token else None


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
    # On a request's first output only: seconds from the scheduler's receipt to admission, and
    # from admission to its first token (prefill; on a decode engine, to the KV's arrival)
    queue_seconds: float | None = None
    prefill_seconds: float | None = None
    # On a prefill engine's answer to a room (its one output): seconds it waited for the
    # decode engine's slots (before its admission, left out of queue_seconds) and from its
    # first token to this output (the KV write); the engine's TTFT leaves them out
    # (docs/server.md, Metrics)
    handoff_seconds: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# -- between the server's processes -------------------------------------------------------


@dataclass
class TokenizeRequest:
    """API server -> tokenizer: a request as the client gave it."""

    rid: str
    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat: rendered with the tokenizer's chat template
    tools: list[dict] | None = None  # chat: the tools the template describes to the model
    add_generation_prompt: bool = True  # chat: the prompt opens the assistant's turn
    continue_final_message: bool = False  # chat: the prompt leaves the last message open
    chat_template_kwargs: dict | None = None  # chat: the client's variables for the template
    # the tokenizer's special tokens (a BOS) around the prompt; None: a text's yes, chat's no
    # (its template writes them)
    add_special_tokens: bool | None = None
    prefix_leader: str | None = None
    bootstrap: BootstrapTarget | None = None
    request_leader: str | None = None  # see GenerateRequest
    probe: bool = False  # see GenerateRequest; and in no request metric


@dataclass
class RoomRefused:
    """API server or tokenizer -> scheduler: a request for a bootstrap room was refused before
    the scheduler saw it (the server's limits, the tokenizer's checks). The role ends the room
    as if the scheduler had refused the request: a prefill engine's decode engine hears of it
    at once, with this answer, instead of waiting for the KV until the router gives up."""

    target: BootstrapTarget
    message: str
    status: int  # the refusal's HTTP status


@dataclass
class TokenizerCall:
    """API server -> tokenizer: /tokenize (the tokens of `prompt`) or /detokenize (the text of
    `token_ids`); answered by a Tokenized of the same call_id, sent no further."""

    call_id: int
    prompt: TokenizeRequest | None = None
    token_ids: list[int] | None = None


@dataclass
class Tokenized:
    """Tokenizer -> API server: the answer to a TokenizerCall."""

    call_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: FinishReason | None = None  # refused or failed: the answer's status and message


@dataclass
class EngineInfo:
    """Scheduler -> API server, once the model is loaded and warmed up."""

    model_path: str
    context_length: int
    vocab_size: int
    max_total_tokens: int
    tp_size: int
    architecture: str
    eos_token_ids: list[int]
    # Prefill and decode engines: the fingerprint of the KV pool's layout (PoolLayout.fingerprint),
    # which /health tells the router (contract.KV_LAYOUT_HEADER); None for a mixed engine
    kv_layout: str | None = None


@dataclass
class DisaggStats:
    """A prefill or decode engine's rooms: gauges, counters since start, and the samples of
    histograms since the last stats (each sample is sent once)."""

    requests_by_state: dict[str, int]  # transferring, awaiting_kv, ... (requests with a room)
    failures_by_reason: dict[str, int]  # since start
    transfers: list[tuple[int, float]]  # (bytes, seconds) of each KV write sent
    kv_waits: list[
        float
    ]  # seconds waited for the other engine (see kubesgl_kv_transfer_wait_seconds)

    def has_samples(self) -> bool:
        return bool(self.transfers or self.kv_waits)


@dataclass
class GrammarStats:
    """Grammar compilations: cache lookups since start, and the compile times since the last
    stats (each sample is sent once)."""

    cache_hits: int = 0
    cache_misses: int = 0
    compile_seconds: list[float] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    prompt_tokens: int  # since start
    cached_prompt_tokens: int  # of those, found in the prefix cache
    disagg: DisaggStats | None = None  # prefill and decode roles
    retractions: int = 0  # since start: running requests sent back to the queue to free KV
    grammar: GrammarStats | None = None  # models with a tokenizer

    def has_samples(self) -> bool:
        """Histogram samples that must go out even when nothing else changed."""
        return (self.disagg is not None and self.disagg.has_samples()) or bool(
            self.grammar and self.grammar.compile_seconds
        )


# Rank 0 sends StepOutputs at least this often, with nothing else to say: the API server's
# watchdog (--watchdog-timeout) takes a scheduler it has not heard from for long to be hung.
HEARTBEAT_S = 1.0


@dataclass
class StepOutputs:
    """Scheduler -> detokenizer, once per step that produced anything, and at least every
    HEARTBEAT_S."""

    outputs: list[TokenOutput]
    stats: SchedulerStats


@dataclass
class TextOutput:
    """Detokenizer -> API server: the new text and tokens of one request."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    token_strings: list[str] | None = None  # the text of each token, and of each top alternative
    top_strings: list[list[str]] | None = None
    token_bytes: list[list[int]] | None = (
        None  # their raw bytes (a token may hold part of a character)
    )
    top_bytes: list[list[list[int]]] | None = None
    queue_seconds: float | None = None  # see TokenOutput
    prefill_seconds: float | None = None
    handoff_seconds: float | None = None
    # Text of these tokens comes with later ones (a character not yet whole, a possible stop
    # string). Never on an engine without a tokenizer, whose tokens bring no text at all.
    text_held: bool = False
    # An engine without a tokenizer: token_strings only name ids ("token_id:N"), no text
    tokens_named_by_id: bool = False


@dataclass
class TextBatch:
    """Detokenizer -> API server: the text outputs of one step, with the scheduler's state."""

    outputs: list[TextOutput]
    stats: SchedulerStats | None = None


@dataclass
class FlushCache:
    """Empties the prefix cache, if the scheduler is idle (SGLang's /flush_cache)."""

    flush_id: int  # echoed in the answer: a flush whose caller gave up leaves no answer unclaimed


@dataclass
class CacheFlushed:
    """Scheduler -> API server, for each FlushCache in turn: whether it flushed (an engine
    with work left, finishing aborted requests or P/D transfers, does not)."""

    flush_id: int
    flushed: bool


@dataclass
class CollectGarbage:
    """Scheduler rank 0 -> every rank, in a turn's broadcast: a full garbage collection now, on
    every rank in the same turn, so that tensor-parallel ranks stall once, together
    (kubesgl/gc_pacing.py)."""


@dataclass
class Shutdown:
    """Ends the process that receives it (and, from rank 0, every scheduler rank)."""
