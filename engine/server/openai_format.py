"""OpenAI's and SGLang's answer bodies: how the outputs of a request's choices become a
final JSON body or a stream of chunks, tool calls included."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class Formatter:
    """How one endpoint shapes its final body and its stream chunks."""

    response_id: str  # the `id` the answer carries (the access log's rid)
    final: Callable[[list[Choice], dict], dict]  # (choices, usage) -> the whole answer
    # (choice, its new output, already added to it) -> a chunk, or None when the output brings
    # nothing to send (a token that ends inside a character, text held back)
    chunk: Callable[[Choice, TextOutput], dict | None]
    # (choices) -> chunks before any output
    stream_start: Callable[[int], list[dict]] = lambda n: []
    usage_chunk: Callable[[dict], dict] = lambda u: {}  # (usage) -> the chunk that carries it


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


def chat_formatter(
    meta: dict, want_logprobs: bool, tools: ToolOutput = ToolOutput("none")
) -> Formatter:
    def final(choices: list[Choice], usage_: dict) -> dict:
        answers = []
        for c in choices:
            reading = tools.read(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": reading.content}
            if reading.calls:
                message["tool_calls"] = [call.as_openai() for call in reading.calls]
            answers.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {"content": c.logprobs} if want_logprobs else None,
                    "finish_reason": tools.finish_reason(c.finish_reason, reading.calls),
                    "stop_reason": stop_reason(c.ending),
                }
            )
        return {**meta, "object": "chat.completion", "usage": usage_, "choices": answers}

    sent: dict[int, int] = {}  # characters of each choice's text streamed as content

    def chunk_of(choices: list[dict]) -> dict:
        return {**meta, "object": "chat.completion.chunk", "choices": choices}

    def start(n: int) -> list[dict]:
        # a chunk per choice, as OpenAI and vLLM send them: each chunk holds one choice
        return [
            chunk_of(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ]
            )
            for i in range(n)
        ]

    def chunk(choice: Choice, out: TextOutput) -> dict | None:
        logprobs = {"content": logprob_entries(out)} if want_logprobs and out.logprobs else None
        reason = out.finish_reason.kind if out.finish_reason else None
        delta, calls = content_delta(choice, out, reason)
        if not (delta.get("content") or calls or logprobs or reason):
            return None
        return chunk_of(
            [
                {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": tools.finish_reason(reason, calls),
                    "stop_reason": stop_reason(out.finish_reason),
                }
            ]
        )

    def content_delta(
        choice: Choice, out: TextOutput, reason: str | None
    ) -> tuple[dict[str, Any], list[tool_calls.ToolCall]]:
        if tools.mode == "none":  # mid-stream chunks always carry content, if only ""
            return ({"content": out.text} if out.text or reason is None else {}), []
        done = sent.get(choice.index, 0)
        calls: list[tool_calls.ToolCall] = []
        if reason is None:
            upto = max(done, tools.held_from(choice.text))
        else:  # the whole answer: what was held back is content, or calls with the content before them
            reading = tools.read(choice.text)
            upto, calls = max(done, reading.content_end), reading.calls
        delta: dict[str, Any] = {"content": choice.text[done:upto]} if upto > done else {}
        sent[choice.index] = upto
        if calls:
            delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(calls)]
        return delta, calls

    return Formatter(meta["id"], final, chunk, start, lambda u: {**chunk_of([]), "usage": u})


def completion_formatter(meta: dict, want_logprobs: bool) -> Formatter:
    def final(choices: list[Choice], usage_: dict) -> dict:
        return {
            **meta,
            "object": "text_completion",
            "usage": usage_,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": (
                        completion_logprobs(
                            c.logprobs, text_lengths(c.logprobs, c.tokens_named_by_id)
                        )
                        if want_logprobs
                        else None
                    ),
                    "finish_reason": c.finish_reason,
                    "stop_reason": stop_reason(c.ending),
                }
                for c in choices
            ],
        }

    text_offsets: dict[int, int] = {}  # where each choice's next token starts in its text

    def chunk(choice: Choice, out: TextOutput) -> dict | None:
        logprobs = None
        if want_logprobs and out.logprobs:
            # counted token by token, as in the whole answer, not from the text sent so far:
            # text held back (part of a character, a possible stop string) comes later
            entries, start = logprob_entries(out), text_offsets.get(choice.index, 0)
            lengths = text_lengths(entries, out.tokens_named_by_id)
            logprobs = completion_logprobs(entries, lengths, start)
            text_offsets[choice.index] = start + sum(lengths)
        # A token whose text comes later sends nothing now (an engine without a tokenizer
        # holds none back: each of its tokens is a chunk, with no text)
        news = out.text or (out.token_ids and not out.text_held)
        if not (news or logprobs or out.finish_reason):
            return None
        return {
            **meta,
            "object": "text_completion",
            "choices": [
                {
                    "index": choice.index,
                    "text": out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason.kind if out.finish_reason else None,
                    "stop_reason": stop_reason(out.finish_reason),
                }
            ],
        }

    return Formatter(
        meta["id"],
        final,
        chunk,
        usage_chunk=lambda u: {**meta, "object": "text_completion", "choices": [], "usage": u},
    )


def native_formatter(rid: str, top_logprobs: bool = False) -> Formatter:
    """SGLang's /generate answer; `top_logprobs`: the request asked for top_logprobs_num > 0,
    which SGLang answers in output_top_logprobs."""

    def body(choice: Choice) -> dict:
        logprobs: dict[str, list] = {}
        if choice.logprobs:
            logprobs["output_token_logprobs"] = [
                [e["logprob"], token_id, e["token"]]
                for e, token_id in zip(choice.logprobs, choice.token_ids)
            ]
            if top_logprobs:
                logprobs["output_top_logprobs"] = [
                    [
                        [t["logprob"], token_id, t["token"]]
                        for t, token_id in zip(e["top_logprobs"], ids)
                    ]
                    for e, ids in zip(choice.logprobs, choice.top_token_ids)
                ]
        return {
            "text": choice.text,
            "output_ids": choice.token_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": native_finish(choice.ending),
                "prompt_tokens": choice.prompt_tokens,
                "completion_tokens": len(choice.token_ids),
                "cached_tokens": choice.cached_tokens,
                **logprobs,
            },
        }

    return Formatter(rid, lambda choices, _: body(choices[0]), lambda choice, out: body(choice))
