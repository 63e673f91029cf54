"""OpenAI's and SGLang's answer bodies: how the outputs of a request's choices become a
final JSON body or a stream of chunks, tool calls included."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubesgl.engine.messages import FinishReason, TextOutput
from kubesgl.engine.server import tool_calls


@dataclass
class Choice:
    """One generated sequence as it accumulates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ending: FinishReason | None = None  # why it ended, once it has
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    # each logprob entry's top alternatives' token ids: /generate answers them, OpenAI's routes
    # do not (their entries are sent as they are)
    top_token_ids: list[list[int]] = field(default_factory=list)
    error: FinishReason | None = None  # how it failed, if it did
    tokens_named_by_id: bool = False  # see TextOutput

    @property
    def finish_reason(self) -> str | None:
        return self.ending.kind if self.ending is not None else None

    def add(self, out: TextOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.tokens_named_by_id = out.tokens_named_by_id
        if out.logprobs:
            self.logprobs += logprob_entries(out)
            self.top_token_ids += [[token_id for token_id, _ in lp.top] for lp in out.logprobs]
        if out.finish_reason is not None:
            self.ending = out.finish_reason
            if out.finish_reason.kind == "error":
                self.error = out.finish_reason


def logprob_entries(out: TextOutput) -> list[dict]:
    # the detokenizer fills these together with logprobs
    assert (
        out.logprobs is not None
        and out.token_strings is not None
        and out.token_bytes is not None
        and out.top_strings is not None
        and out.top_bytes is not None
    )
    return [
        {
            "token": token,
            "logprob": lp.logprob,
            "bytes": raw,
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": b}
                for t, b, (_, v) in zip(tops, top_raw, lp.top)
            ],
        }
        for lp, token, raw, tops, top_raw in zip(
            out.logprobs, out.token_strings, out.token_bytes, out.top_strings, out.top_bytes
        )
    ]


def text_lengths(entries: list[dict], named_by_id: bool) -> list[int]:
    """The characters of the answer's text each token brings, which its text_offset counts:
    none where tokens are named by id (an engine without a tokenizer returns no text)."""
    return [0] * len(entries) if named_by_id else [len(e["token"]) for e in entries]


def completion_logprobs(entries: list[dict], lengths: list[int], start_offset: int = 0) -> dict:
    offsets, position = [], start_offset
    for length in lengths:
        offsets.append(position)
        position += length
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_top_with_sampled(e) for e in entries],
        "text_offset": offsets,
    }


def _top_with_sampled(entry: dict) -> dict[str, float]:
    """The top tokens and the sampled one, as OpenAI's completions give them: up to logprobs + 1
    entries, and `logprobs: 0` still names the token chosen. Keyed by text, so a top token
    keeps its entry where the sampled one reads the same (parts of characters all read U+FFFD)."""
    top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
    top.setdefault(entry["token"], entry["logprob"])
    return top


def usage(choices: list[Choice], prompts_counted: set[int]) -> dict:
    prompt = sum(c.prompt_tokens for c in choices if c.index in prompts_counted)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices if c.index in prompts_counted)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Formatter(ABC):
    """How one endpoint shapes one request's answer: its final body, or its stream's chunks.
    One per request: a stream's formatter may remember what it has sent."""

    @property
    @abstractmethod
    def response_id(self) -> str:
        """The `id` the answer carries (the access log's rid)."""

    @abstractmethod
    def final(self, choices: list[Choice], usage_: dict) -> dict:
        """The whole answer, from its choices and their usage."""

    @abstractmethod
    def chunk(self, choice: Choice, out: TextOutput) -> dict | None:
        """The chunk of a choice's new output (already added to the choice), or None when the
        output brings nothing to send (a token that ends inside a character, text held back)."""

    def stream_start(self, n: int) -> list[dict]:
        """The chunks sent before any output of the n choices: none, unless an endpoint opens
        its stream with some."""
        return []

    @abstractmethod
    def usage_chunk(self, usage_: dict) -> dict:
        """The chunk that carries the usage, after every choice's last."""


@dataclass(frozen=True)
class Reading:
    """A chat answer read for tool calls."""

    content: str | None
    calls: list[tool_calls.ToolCall]
    content_end: int  # the text before this is content: what a stream sends as content


@dataclass(frozen=True)
class ToolOutput:
    """How a chat answer becomes tool calls: never ("none"), always (a "required" list of calls
    unless cut before its first, or the "named" function's arguments), or where the model
    wrote its own format ("auto")."""

    mode: tool_calls.ToolMode
    name: str | None = None  # the named function
    format: tool_calls.ToolCallFormat | None = None  # "auto": the model's format, if known
    # "auto": the functions the request's tools declare (None: any name is taken)
    declared: frozenset[str] | None = None
    parallel: bool = True  # "auto": more than one call allowed (the grammar sees to "required")

    def read(self, text: str) -> Reading:
        """The content and calls of a whole answer, whole or cut by max_tokens."""
        return _READERS[self.mode](self, text)

    def finish_reason(self, reason: str | None, calls: list) -> str | None:
        """An answer of calls that stopped ends "tool_calls"; one of a forced named function
        ends "stop", as OpenAI's (and vLLM's): the client asked for that call, nothing more."""
        return "tool_calls" if calls and reason == "stop" and self.mode != "named" else reason

    def held_from(self, text: str) -> int:
        """Where streamed content must stop until the answer is whole: what follows may be a call."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode != "auto" or self.format is None:
            return len(text)
        # whitespace before a call is no content (the whole answer's is cut): held until
        # text follows it
        return len(text[: self.format.held_from(text)].rstrip())


def _as_text(_: ToolOutput, text: str) -> Reading:
    return Reading(text, [], len(text))


def _auto(tools: ToolOutput, text: str) -> Reading:
    """The calls the model wrote in its format. An answer that calls a function its tools do
    not declare is text, all of it: nothing the model wrote is lost (SGLang drops the call)."""
    if tools.format is None:
        return _as_text(tools, text)
    at, calls = tools.format.calls_in(text, first_only=not tools.parallel)
    declared = tools.declared
    if not calls or (declared is not None and any(c.name not in declared for c in calls)):
        return _as_text(tools, text)
    content = text[:at].rstrip()
    return Reading(content or None, calls, len(content))


def _required(tools: ToolOutput, text: str) -> Reading:
    """The calls of the grammar's JSON list. A list cut short (max_tokens) before its first
    call's name was whole holds none: its text is the content, not lost (as SGLang answers)."""
    calls = tool_calls.parse_required(text)
    return Reading(None, calls, 0) if calls else _as_text(tools, text)


def _named(tools: ToolOutput, text: str) -> Reading:
    # the arguments as the model wrote them, cut short if max_tokens came first (as vLLM)
    assert tools.name is not None  # the "named" mode names its function
    return Reading(None, [tool_calls.ToolCall(tools.name, text)], 0)


_READERS: dict[tool_calls.ToolMode, Callable[[ToolOutput, str], Reading]] = {
    "none": _as_text,
    "auto": _auto,
    "required": _required,
    "named": _named,
}


def stop_reason(reason: FinishReason | None) -> int | str | None:
    """A choice's `stop_reason`, as vLLM's: the stop string or stop_token_ids entry that ended
    it; None on EOS, length, or a choice (chunk) that has not ended."""
    return reason.stop_reason if reason is not None else None


def native_finish(reason: FinishReason | None) -> dict | None:
    """SGLang's meta_info.finish_reason: its kind, and for "stop" the string or token matched."""
    if reason is None:
        return None
    return (
        {"type": reason.kind, "matched": reason.matched}
        if reason.kind == "stop"
        else {"type": reason.kind}
    )


@dataclass
class OpenAIFormatter(Formatter):
    """What OpenAI's answers share: every body and chunk opens with the request's meta and
    the name of its object, and the usage comes in a chunk of no choices."""

    meta: dict  # the id, created and model every body and chunk of the request carries
    want_logprobs: bool
    final_object: ClassVar[str]  # the whole answer's "object"
    chunk_object: ClassVar[str]  # a stream chunk's "object"

    @property
    def response_id(self) -> str:
        return self.meta["id"]

    def final(self, choices: list[Choice], usage_: dict) -> dict:
        body = [self.final_choice(c) for c in choices]
        return {**self.meta, "object": self.final_object, "usage": usage_, "choices": body}

    @abstractmethod
    def final_choice(self, choice: Choice) -> dict:
        """A choice as the whole answer shows it."""

    def chunk_of(self, choices: list[dict]) -> dict:
        return {**self.meta, "object": self.chunk_object, "choices": choices}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self.chunk_of([]), "usage": usage_}


@dataclass
class ChatFormatter(OpenAIFormatter):
    """/v1/chat/completions: messages, and the tool calls the request's tools make of them."""

    tools: ToolOutput = ToolOutput("none")
    # characters of each choice's text streamed as content so far: content that may turn out
    # to be a call is held back, and sent (or not) when the answer is whole
    content_sent: dict[int, int] = field(default_factory=dict, init=False)
    final_object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def final_choice(self, choice: Choice) -> dict:
        reading = self.tools.read(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": reading.content}
        if reading.calls:
            message["tool_calls"] = [call.as_openai() for call in reading.calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": {"content": choice.logprobs} if self.want_logprobs else None,
            "finish_reason": self.tools.finish_reason(choice.finish_reason, reading.calls),
            "stop_reason": stop_reason(choice.ending),
        }

    def stream_start(self, n: int) -> list[dict]:
        # a chunk per choice, as OpenAI and vLLM send them: each chunk holds one choice
        return [self.chunk_of([self.role_choice(i)]) for i in range(n)]

    @staticmethod
    def role_choice(index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }

    def chunk(self, choice: Choice, out: TextOutput) -> dict | None:
        logprobs = self.streamed_logprobs(out)
        reason = out.finish_reason.kind if out.finish_reason else None
        delta, calls = self.delta(choice, out, reason)
        if not (delta.get("content") or calls or logprobs or reason):
            return None
        sent = {
            "index": choice.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": self.tools.finish_reason(reason, calls),
            "stop_reason": stop_reason(out.finish_reason),
        }
        return self.chunk_of([sent])

    def streamed_logprobs(self, out: TextOutput) -> dict | None:
        return {"content": logprob_entries(out)} if self.want_logprobs and out.logprobs else None

    def delta(
        self, choice: Choice, out: TextOutput, reason: str | None
    ) -> tuple[dict[str, Any], list[tool_calls.ToolCall]]:
        """The chunk's delta, and the calls it carries."""
        if self.tools.mode == "none":  # mid-stream chunks always carry content, if only ""
            return ({"content": out.text} if out.text or reason is None else {}), []
        return self.delta_with_tools(choice, reason)

    def delta_with_tools(
        self, choice: Choice, reason: str | None
    ) -> tuple[dict[str, Any], list[tool_calls.ToolCall]]:
        """Mid-stream, the content before where a call may begin; at the end, what was held
        back: content, or the calls with the content before them."""
        done = self.content_sent.get(choice.index, 0)
        calls: list[tool_calls.ToolCall] = []
        if reason is None:
            upto = max(done, self.tools.held_from(choice.text))
        else:
            reading = self.tools.read(choice.text)
            upto, calls = max(done, reading.content_end), reading.calls
        delta: dict[str, Any] = {"content": choice.text[done:upto]} if upto > done else {}
        self.content_sent[choice.index] = upto
        if calls:
            delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(calls)]
        return delta, calls


@dataclass
class CompletionFormatter(OpenAIFormatter):
    """/v1/completions: text, with logprobs in the completions API's shape."""

    # where each choice's next token starts in its text: a chunk's text_offset goes on from
    # the chunks before it
    next_text_offset: dict[int, int] = field(default_factory=dict, init=False)
    final_object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    def final_choice(self, choice: Choice) -> dict:
        logprobs = None
        if self.want_logprobs:
            lengths = text_lengths(choice.logprobs, choice.tokens_named_by_id)
            logprobs = completion_logprobs(choice.logprobs, lengths)
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": stop_reason(choice.ending),
        }

    def chunk(self, choice: Choice, out: TextOutput) -> dict | None:
        logprobs = self.streamed_logprobs(choice, out)
        # A token whose text comes later sends nothing now (an engine without a tokenizer
        # holds none back: each of its tokens is a chunk, with no text)
        news = out.text or (out.token_ids and not out.text_held)
        if not (news or logprobs or out.finish_reason):
            return None
        sent = {
            "index": choice.index,
            "text": out.text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason.kind if out.finish_reason else None,
            "stop_reason": stop_reason(out.finish_reason),
        }
        return self.chunk_of([sent])

    def streamed_logprobs(self, choice: Choice, out: TextOutput) -> dict | None:
        if not (self.want_logprobs and out.logprobs):
            return None
        # text offsets counted token by token, as in the whole answer, not from the text sent
        # so far: text held back (part of a character, a possible stop string) comes later
        entries, start = logprob_entries(out), self.next_text_offset.get(choice.index, 0)
        lengths = text_lengths(entries, out.tokens_named_by_id)
        self.next_text_offset[choice.index] = start + sum(lengths)
        return completion_logprobs(entries, lengths, start)


@dataclass
class NativeFormatter(Formatter):
    """SGLang's /generate answer: each chunk is the whole answer so far, as SGLang streams it.
    `top_logprobs`: the request asked for top_logprobs_num > 0, which SGLang answers in
    output_top_logprobs."""

    rid: str
    top_logprobs: bool = False

    @property
    def response_id(self) -> str:
        return self.rid

    def final(self, choices: list[Choice], usage_: dict) -> dict:
        return self.body(choices[0])  # /generate asks for one choice; its meta_info counts usage

    def chunk(self, choice: Choice, out: TextOutput) -> dict | None:
        return self.body(choice)

    def usage_chunk(self, usage_: dict) -> dict:
        return {}  # never asked: /generate takes no include_usage

    def body(self, choice: Choice) -> dict:
        return {
            "text": choice.text,
            "output_ids": choice.token_ids,
            "meta_info": {
                "id": self.rid,
                "finish_reason": native_finish(choice.ending),
                "prompt_tokens": choice.prompt_tokens,
                "completion_tokens": len(choice.token_ids),
                "cached_tokens": choice.cached_tokens,
                **self.logprob_fields(choice),
            },
        }

    def logprob_fields(self, choice: Choice) -> dict[str, list]:
        if not choice.logprobs:
            return {}
        fields: dict[str, list] = {
            "output_token_logprobs": [
                [e["logprob"], token_id, e["token"]]
                for e, token_id in zip(choice.logprobs, choice.token_ids)
            ]
        }
        if self.top_logprobs:
            fields["output_top_logprobs"] = [
                [
                    [t["logprob"], token_id, t["token"]]
                    for t, token_id in zip(e["top_logprobs"], ids)
                ]
                for e, ids in zip(choice.logprobs, choice.top_token_ids)
            ]
        return fields
