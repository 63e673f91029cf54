"""Reads a generation request: validates what the router relies on, derives its routing text.

The engine validates everything else; the router only needs the JSON object, the `stream`
flag and a text whose prefixes mirror the prompt's, for the cache-aware policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubesgl.contract import EMPTY_BODY, MAX_N, TOO_DEEP_BODY, not_json
from kubesgl.router.errors import bad_request

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH, GENERATE_PATH)

# What the router adds to a request it splits between a prefill and a decode worker (pd.py):
# where the decode engine fetches the KV from. A client may not set them, or it could point a
# decode engine at any address it likes.
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

# Characters per token of typical BPE vocabularies on English text: how the router, which
# does not tokenize, estimates a text prompt's length in tokens.
CHARS_PER_TOKEN = 4
# Separators that cannot occur in ordinary text keep message boundaries apart in the key.
_ROLE_SEP, _MESSAGE_SEP = "\x1f", "\x1e"


@dataclass(frozen=True)
class ParsedRequest:
    path: str
    body: dict[str, Any]
    raw: bytes
    routing_text: str
    stream: bool
    choices: int  # sequences the request asks for: prompts x n
    token_ids: bool  # the routing text holds one character per prompt token (a token-id prompt)
    model: str | None = None  # the model it names; None: any worker's (/generate names none)
    # A batch's prompts after the first, which the routing text (the first's) leaves out: their
    # length in the routing text's units (characters, or ids of a token-id prompt)
    more_prompt_chars: int = 0

    @property
    def prompt_chars(self) -> int:
        """The length of all its prompts (each once, whatever `n`), in routing text units."""
        return len(self.routing_text) + self.more_prompt_chars

    def tokens(self, chars: int) -> int:
        """Prompt tokens that `chars` characters of the routing text stand for: exact for a
        token-id prompt, an estimate (CHARS_PER_TOKEN) for text, which the router does not tokenize."""
        return chars if self.token_ids else -(-chars // CHARS_PER_TOKEN)


def _token_ids_text(ids: list[Any], param: str) -> str:
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise bad_request(f"`{param}` must be a list of non-negative integers", param)
    # One character per token id: prefixes of ids become prefixes of text.
    return "".join(chr(i % 0x110000) for i in ids)


@dataclass(frozen=True)
class _Prompts:
    """A request's prompts as the router sees them. The first prompt routes a batch: its
    prompts usually share a prefix (a system prompt, few-shot examples), which a worker's
    cache holds once."""

    text: str  # the routing text of the first prompt
    count: int
    token_ids: bool  # given as token ids, one character of `text` each
    more_chars: int  # the length of the prompts after the first (characters, or token ids)


def _prompts_in(prompt: Any, param: str) -> _Prompts:
    """The prompts of a `prompt`/`text`/`input_ids` value."""
    if isinstance(prompt, str):
        return _Prompts(prompt, 1, False, 0)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _Prompts(prompt[0], len(prompt), False, sum(map(len, prompt[1:])))
        if all(isinstance(p, list) for p in prompt):
            ids = _token_ids_text(prompt[0], param)
            return _Prompts(ids, len(prompt), True, sum(map(len, prompt[1:])))
        return _Prompts(_token_ids_text(prompt, param), 1, True, 0)
    raise bad_request(
        f"`{param}` must be a string, a list of strings, or a non-empty list of token ids", param
    )


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise bad_request(f"messages[{index}].content parts must be objects", "messages")
            text = part.get("text")
            parts.append(text if isinstance(text, str) else json.dumps(part, sort_keys=True))
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of parts", "messages")


def _chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of messages", "messages")
    pieces = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}] must be an object with a `role`", "messages")
        text = _content_text(message.get("content"), index)
        pieces.append(message["role"] + _ROLE_SEP + text + _MESSAGE_SEP)
    return "".join(pieces)


def requested_model(body: Any) -> str | None:
    """The `model` a request body names, for routing; a value that is no string routes as
    none, and the engine refuses it."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _sample_count(value: Any, param: str) -> int:
    """`n` as engines read it: a whole number (2.0 is 2), not a boolean or a string."""
    if value is None:
        return 1
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 1 <= value <= MAX_N:
        raise bad_request(f"`{param}` must be an integer from 1 to {MAX_N}", param)
    return int(value)


def _chat_prompts(body: dict[str, Any]) -> tuple[_Prompts, int]:
    return _Prompts(_chat_text(body), 1, False, 0), _sample_count(body.get("n"), "n")


def _completion_prompts(body: dict[str, Any]) -> tuple[_Prompts, int]:
    if "prompt" not in body:
        raise bad_request("`prompt` is required", "prompt")
    return _prompts_in(body["prompt"], "prompt"), _sample_count(body.get("n"), "n")


def _generate_prompts(body: dict[str, Any]) -> tuple[_Prompts, int]:
    """SGLang's /generate: one sequence per prompt (engines refuse sampling_params.n other
    than 1)."""
    if "text" in body:
        prompts = _prompts_in(body["text"], "text")
    elif "input_ids" in body:
        prompts = _prompts_in(body["input_ids"], "input_ids")
    else:
        raise bad_request("`text` or `input_ids` is required", "text")
    sampling = body.get("sampling_params")
    if sampling is None:
        sampling = {}
    elif not isinstance(sampling, dict):
        raise bad_request("`sampling_params` must be an object", "sampling_params")
    n = _sample_count(sampling.get("n"), "sampling_params.n")
    if n != 1:
        raise bad_request(
            f"/generate answers one sequence per prompt, got {n}; "
            "ask /v1/completions with n for more",
            "sampling_params.n",
        )
    return prompts, n


# Where each generation route's body holds its prompts, and how many sequences (`n`) each
# prompt asks for.
_PROMPT_READERS: dict[str, Callable[[dict[str, Any]], tuple[_Prompts, int]]] = {
    CHAT_PATH: _chat_prompts,
    COMPLETIONS_PATH: _completion_prompts,
    GENERATE_PATH: _generate_prompts,
}
assert set(_PROMPT_READERS) == set(GENERATION_PATHS)


def parse_generation_request(path: str, raw: bytes) -> ParsedRequest:
    if not raw:
        raise bad_request(EMPTY_BODY)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(not_json(exc)) from None
    except RecursionError:
        raise bad_request(TOO_DEEP_BODY) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for field in BOOTSTRAP_FIELDS:
        if field in body:
            raise bad_request(f"`{field}` is set by the router, not by clients", field)
    stream = body.get("stream")
    if stream is None:  # left out, or null: OpenAI reads both as false
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false", "stream")

    prompts, n = _PROMPT_READERS[path](body)
    # SGLang's /generate has no model: engines answer it with theirs, whatever it names
    model = None if path == GENERATE_PATH else requested_model(body)
    return ParsedRequest(
        path,
        body,
        raw,
        prompts.text,
        stream,
        prompts.count * n,
        prompts.token_ids,
        model,
        prompts.more_chars,
    )
