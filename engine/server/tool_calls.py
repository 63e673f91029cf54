"""Tool calling: a chat request's `tool_choice` (ToolChoice), the grammar that "required" or a
named function imposes, and the parsers that read a model's own tool-call format out of its
answer (`tool_choice` "auto"), chosen from the model's chat template."""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kubesgl.engine.sampling_params import GrammarSpec

# How a chat answer relates to its tools: no calls ("none"), calls where the model writes them
# in its own format ("auto"), a list of calls ("required"), or the arguments of one named
# function ("named")
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call_of(obj: Any) -> ToolCall | None:
    """{"name": ..., "arguments" or "parameters": {...}} as a call; None for anything else (a
    name alone is no call: JSON an answer shows may have a "name" too)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        return None
    arguments = obj[key]
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's way of writing tool calls in its answer."""

    name: str
    template_marker: str  # the chat template of a model that writes this format holds this text
    # where calls may begin: anywhere (text before them is the message's content), or only at
    # the answer's start, after whitespace (a "{" later in an answer is JSON it shows)
    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()

    def find_start(self, text: str) -> int:
        """Where the first call may begin, -1 if nowhere."""
        found = [at for at in (text.find(m) for m in self.markers) if at >= 0]
        if text.lstrip().startswith(self.leading):
            found.append(0)  # the whitespace before it is no content
        return min(found, default=-1)

    def held_from(self, text: str) -> int:
        """Where streamed content must stop until the answer is whole: what follows may be a
        call, or the start of a marker cut across chunks."""
        at = self.find_start(text)
        if at >= 0:
            return at
        if any(m.startswith(text.lstrip()) for m in self.leading):
            return 0
        held = len(text)
        for marker in self.markers:
            for keep in range(min(len(marker) - 1, len(text)), 0, -1):
                if marker.startswith(text[-keep:]):
                    held = min(held, len(text) - keep)
                    break
        return held

    def calls_in(self, text: str, first_only: bool = False) -> tuple[int, list[ToolCall]]:
        """(where the calls begin, the calls) of an answer, or of its first call only; no
        calls where one of those fails to parse."""
        at = self.find_start(text)
        if at < 0:
            return len(text), []
        calls = _PARSERS[self.name](text[at:])
        if first_only:
            calls = calls[:1]
        return at, [] if None in calls else [call for call in calls if call is not None]


# A parser reads the calls an answer holds from where they begin: one entry per call the
# model wrote, in order, None for one that is no call (not JSON, cut short, no arguments).


def _parse_qwen(text: str) -> list[ToolCall | None]:
    # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call
    calls: list[ToolCall | None] = []
    for block in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL):
        try:
            calls.append(_call_of(json.loads(block)))
        except (ValueError, RecursionError):  # nested past what json reads
            calls.append(None)
    return calls


def _parse_llama3_json(text: str) -> list[ToolCall | None]:
    # Llama 3.1's JSON tool calls: {"name": ..., "parameters": {...}}, several separated by ";"
    body = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, at = json.JSONDecoder(), 0
    calls: list[ToolCall | None] = []
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
            call = _call_of(obj)
        except (ValueError, RecursionError):  # nested past what json reads or writes
            return [*calls, None]  # what follows cannot be split into calls
        calls.append(call)
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return calls


_PARSERS: dict[str, Callable[[str], list[ToolCall | None]]] = {
    "qwen": _parse_qwen,
    "llama3_json": _parse_llama3_json,
}
# In order: the first whose marker the chat template holds is the model's format.
FORMATS = (
    ToolCallFormat("qwen", template_marker="<tool_call>", markers=("<tool_call>",)),
    ToolCallFormat(
        "llama3_json", template_marker="<|python_tag|>", leading=("<|python_tag|>", "{")
    ),
)


def format_for_template(template: str | None) -> ToolCallFormat | None:
    for fmt in FORMATS:
        if template and fmt.template_marker in template:
            return fmt
    return None


@functools.cache  # read once: a served model's template does not change
def format_for_model(model_dir: str) -> ToolCallFormat | None:
    return format_for_template(read_chat_template(model_dir))


def read_chat_template(model_dir: str) -> str | None:
    """The chat template text of a model folder (tokenizer_config.json or chat_template.jinja)."""
    folder = Path(model_dir)
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        template = None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return template


def required_grammar(tools: list[dict[str, Any]], parallel: bool = True) -> GrammarSpec:
    """tool_choice "required": a JSON list of one or more calls of the given tools (exactly one
    without parallel calls)."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "required": ["name", "parameters"],
                "properties": {
                    "name": {"enum": [t["function"]["name"]]},
                    "parameters": t["function"].get("parameters") or {"type": "object"},
                },
            }
            for t in tools
        ]
    }
    schema = {
        "type": "array",
        "minItems": 1,
        "items": call,
        **({} if parallel else {"maxItems": 1}),
    }
    return GrammarSpec("json_schema", json.dumps(schema), param="tools")


def named_grammar(tool: dict[str, Any]) -> GrammarSpec:
    """A named function: the answer is that function's arguments."""
    return GrammarSpec(
        "json_schema",
        json.dumps(tool["function"].get("parameters") or {"type": "object"}),
        param="tools",
    )


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tool_choice, checked against its tools."""

    mode: ToolMode
    named: dict[str, Any] | None = None  # "named": the tool it names, as `tools` declares it
    # the request's tools, as the chat template takes them; none in mode "none", whose
    # template is not shown them
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders: None, no tools, in mode "none"."""
        return list(self.tools) or None

    def grammar(self, parallel: bool) -> GrammarSpec | None:
        """The constraint a "required" or "named" choice puts on the answer; None otherwise
        (`parallel`: more than one call allowed)."""
        if self.named is not None:  # set in mode "named", and only there
            return named_grammar(self.named)
        if self.mode == "required":
            return required_grammar(list(self.tools), parallel)
        return None


# The start of a call cut short, up to its name and any arguments that came
_CUT_CALL = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"parameters"\s*:\s*(.*))?', re.DOTALL
)


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a "required" answer, a JSON list: its whole calls and, where max_tokens
    cut the last one after its name, that one with its arguments as far as they came."""
    decoder = json.JSONDecoder(strict=False)
    calls: list[ToolCall] = []
    at = text.find("[") + 1
    while (at := _past_separators(text, at)) < len(text) and text[at] != "]":
        try:
            obj, end = decoder.raw_decode(text, at)
            call = _call_of(obj)
        except (ValueError, RecursionError):  # nested past what json reads or writes
            return calls + _cut_call(text[at:])
        at = end
        if call is not None:
            calls.append(call)
    return calls


def _past_separators(text: str, at: int) -> int:
    while at < len(text) and text[at] in ", \n\t\r":
        at += 1
    return at


def _cut_call(text: str) -> list[ToolCall]:
    match = _CUT_CALL.match(text)
    return [] if match is None else [ToolCall(json.loads(match[1]), match[2] or "")]
