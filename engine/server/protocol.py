"""OpenAI-compatible request bodies (and SGLang's native /generate). Unknown fields are
accepted and ignored, as OpenAI does; wrong types and out-of-range values are 400s (no string
read as a number or a boolean), and so are OpenAI fields this server does not implement,
unless they ask for nothing. A null given for a field that cannot be null reads as the field
left out (its default), as OpenAI reads it; where null has a meaning of its own, it keeps it
(`max_tokens: null` on /v1/completions is no limit)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from kubesgl.contract import MAX_BOOTSTRAP_ROOM, MAX_N
from kubesgl.engine.messages import BootstrapTarget
from kubesgl.engine.sampling_params import (
    LOGIT_BIAS_BOUND,
    SAMPLING_BOUNDS,
    SGLANG_GRAMMAR_FIELDS,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
    is_utf8,
)
from kubesgl.engine.server.tool_calls import ToolChoice

UTF8_ERROR = "invalid_utf8"
UTF8_MESSAGE = "is not valid UTF-8 text (it holds a lone surrogate)"
UNSUPPORTED_ERROR = "unsupported"


def _utf8(value: str) -> str:
    if not is_utf8(value):
        raise PydanticCustomError(UTF8_ERROR, UTF8_MESSAGE)
    return value


def unsupported_unless(*no_ops: Any, instead: str = "") -> AfterValidator:
    """An OpenAI field this server does not implement: a 400 for any value but those that ask
    for nothing (a client that sends the default still works); `instead` names what to use."""

    def check(value: Any) -> Any:
        if value not in no_ops:
            raise PydanticCustomError(
                UNSUPPORTED_ERROR,
                "is not supported by this server" + (f": use {instead}" if instead else ""),
            )
        return value

    return AfterValidator(check)


Text = Annotated[str, AfterValidator(_utf8)]
"""Every string a request carries: valid UTF-8, or a 400 that names the field."""


def _utf8_throughout(value: Any) -> Any:
    """Every key and string of a JSON value, however deep, is valid UTF-8 (a schema, a tool's
    parameters, template variables), or the 400 of Text, not the schema compiler's or the
    template's words for it later."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            _utf8(item)
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_utf8_throughout)]


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # maybe one: then the text is read


def _utf8_json_text(text: str) -> str:
    """A schema given as text holds no escape of a lone surrogate ("\\ud800") either; text
    that is no JSON is left to the schema compiler's 400. Text without an escape of a
    surrogate is not parsed (a 0.6 MB schema took 16 ms, on the event loop); text with one is
    parsed and its strings read (matching its every escape in Python instead took 148 ms for
    2 MB of "\\n" after a surrogate pair, where a parse takes 5.5 ms)."""
    if not _SURROGATE_ESCAPE.search(text):
        return text
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested too deep: the compiler's 400 says so
        return text
    _utf8_throughout(value)
    return text


JsonText = Annotated[Text, AfterValidator(_utf8_json_text)]


def _a_number(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would take `true` for 1, as Python does
        raise PydanticCustomError("not_a_number", "must be a number, not true or false")
    if isinstance(value, str):  # and "3" for 3
        raise PydanticCustomError("not_a_number", "must be a number, not a string")
    return value


def _an_integer(value: Any) -> Any:
    """A whole float as the integer it is (`1e30`): pydantic converts one only within 64 bits,
    and called a larger one "Unable to parse input string", though a number was sent; as an
    int, the field's bounds answer it, as they answer `10**30`."""
    value = _a_number(value)
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_an_integer)]
Float = Annotated[float, BeforeValidator(_a_number)]
"""Every number a request carries: `"max_tokens": true` or `"3"` is a 400 (as at OpenAI)."""

Seed = Annotated[Int, Field(ge=-(2**63), le=2**63 - 1)]
"""A sampling seed: a signed 64-bit integer, as vLLM's schema bounds it (a seed vLLM refuses
is refused here too, not sampled as its remainder)."""


def engine_bounds(name: str) -> FieldInfo:
    """The limits of the engine's sampling field `name` (SAMPLING_BOUNDS), for the request
    field that sets it: a value out of them is a 400 naming the field as the client wrote it."""
    return Field(**SAMPLING_BOUNDS[name].limits())


MAX_TOKEN_ID = 2**63 - 1  # a token id is a 64-bit integer wherever it goes


def _token_id_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's logit_bias is keyed by token ids written as text ("50256"), not by tokens.
    Every key is checked here, so that logit_bias_by_id cannot fail on one (int() refuses more
    than 4300 digits): a key is a 64-bit token id at most, and no two keys name one token
    ("7" and "007": the bias a client meant for it is not known)."""
    keys: dict[int, str] = {}
    for key in value or {}:
        digits = key.lstrip("0") if key.isascii() and key.isdigit() else None
        if digits is None or len(digits) > 19 or int(digits or "0") > MAX_TOKEN_ID:
            shown = repr(key) if len(key) <= 40 else f"{key[:20]!r}... ({len(key)} characters)"
            raise PydanticCustomError(
                "token_id_key", "keys must be token ids, got {key}", {"key": shown}
            )
        token = int(digits or "0")
        if token in keys:
            raise PydanticCustomError(
                "token_id_key",
                "token {token} is named twice, as {first} and {second}",
                {"token": token, "first": repr(keys[token]), "second": repr(key)},
            )
        keys[token] = key
    return value


LogitBias = Annotated[
    dict[str, Annotated[Float, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)]] | None,
    AfterValidator(_token_id_keys),
]
"""OpenAI's logit_bias: token id -> an amount added to its logit, from -100 to 100."""


def logit_bias_by_id(value: dict[str, float] | None) -> dict[int, float]:
    """A logit_bias _token_id_keys has checked, keyed by token ids."""
    return {int(token): bias for token, bias in (value or {}).items()}


# OpenAI's API caps temperature at 2 (vLLM's newest engine too); SGLang's /generate, and so
# the engine, take any non-negative one. The only limit of one route's own.
OPENAI_MAX_TEMPERATURE = 2

Bool = StrictBool
"""Every flag a request carries: `"stream": "yes"` is a 400, not true."""

TokenId = StrictInt
"""A token id: an integer, never a boolean (`true` is no token)."""


def _prompt_list_form(value: Any) -> str | None:
    """Which list form a completion prompt takes, from its first element: pydantic then
    validates that form alone instead of trying each one over the whole list (a million token
    ids took 0.26 s of the event loop, every other request waiting)."""
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    return (
        "list[int]"
        if type(first) is int
        else "list[list[int]]"
        if isinstance(first, list)
        else "list[str]"
    )


PromptList = Annotated[
    Annotated[Annotated[list[Text], Field(min_length=1)], Tag("list[str]")]
    | Annotated[Annotated[list[TokenId], Field(min_length=1)], Tag("list[int]")]
    | Annotated[
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
        Tag("list[list[int]]"),
    ],
    Discriminator(_prompt_list_form),
]


# The bodies' model classes by name: pydantic puts a union member's class name in the location
# of an error inside it (`tool_choice.NamedToolChoice.type`), which is no field a client wrote.
MODEL_NAMES: set[str] = set()


class _Lenient(BaseModel):
    """Unknown fields ignored; a null given for a field that cannot be null (`"stream": null`,
    as clients that forward unset options send them) is that field's default. Numbers are
    finite: Python's JSON reader takes NaN and Infinity, which are not JSON."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _not_nullable: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        MODEL_NAMES.add(cls.__name__)
        cls._not_nullable = frozenset(
            field.alias or name
            for name, field in cls.model_fields.items()
            if not field.is_required() and not _accepts_null(field.annotation, field.metadata)
        )

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and not cls._not_nullable.isdisjoint(data):
            return {k: v for k, v in data.items() if v is not None or k not in cls._not_nullable}
        return data


def _accepts_null(annotation: Any, metadata: list[Any]) -> bool:
    field_type: Any = Annotated[annotation, *metadata] if metadata else annotation
    try:
        TypeAdapter(field_type).validate_python(None)
    except ValueError:
        return False
    return True


Room = Annotated[Int, Field(ge=0, le=MAX_BOOTSTRAP_ROOM)]


class _Bootstrap(_Lenient):
    """Prefill/decode serving: which room of which prefill engine each choice fills or reads
    (SGLang's field names; one room per choice, as a list, when there are several)."""

    bootstrap_host: Text | list[Text] | None = None
    bootstrap_port: (
        Annotated[Int, Field(ge=1, le=65535)]
        | list[Annotated[Int, Field(ge=1, le=65535)] | None]
        | None
    ) = None
    bootstrap_room: Room | list[Room] | None = None

    def bootstrap_targets(
        self, prompts: int, n: int, default_port: int
    ) -> list[BootstrapTarget | None]:
        """One target per choice, choice p * n + i being copy i of prompt p; None everywhere
        without rooms. Each field may give one value per choice, one per prompt, or one for
        all; a room given per prompt (or for all) numbers its copies room + i, as SGLang's
        engines do (its router sends a single room with n > 1). Raises InvalidRequestError for
        lists that fit neither."""
        if self.bootstrap_room is None:
            if self.bootstrap_host is not None or self.bootstrap_port is not None:
                raise InvalidRequestError(
                    "bootstrap_room is missing (bootstrap_host and bootstrap_port come with it)",
                    param="bootstrap_room",
                )
            return [None] * (prompts * n)
        rooms, hosts, ports = (
            _per_choice(name, getattr(self, name), prompts, n)
            for name in ("bootstrap_room", "bootstrap_host", "bootstrap_port")
        )
        return [
            BootstrapTarget(
                (room + copy) % (MAX_BOOTSTRAP_ROOM + 1),
                host,
                default_port if port is None else port,
            )
            for (room, copy), (host, _), (port, _) in zip(rooms, hosts, ports)
        ]


def _per_choice(name: str, value, prompts: int, n: int) -> list[tuple[Any, int]]:
    """(value, the offset a room adds) for each choice: per choice as given, or spread over
    the copies of each prompt (or of all prompts) with offsets 0, 1, ..."""
    choices = prompts * n
    if isinstance(value, list) and len(value) == choices:
        return [(v, 0) for v in value]
    if isinstance(value, list) and len(value) == prompts:
        return [(v, i) for v in value for i in range(n)]
    if isinstance(value, list):
        raise InvalidRequestError(
            f"{name} lists {len(value)} values for {prompts} prompts x n={n}: give one per "
            "choice, one per prompt, or one for all",
            param=name,
        )
    return [(value, c) for c in range(choices)]


class StreamOptions(_Lenient):
    include_usage: Bool = False
    # vLLM's usage on every chunk: not implemented here
    continuous_usage_stats: Annotated[Bool | None, unsupported_unless(None, False)] = None


class JSONSchemaFormat(_Lenient):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")  # none: any object
    # the schema is always enforced (xgrammar's strict mode: no extra properties)
    strict: Bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that fits a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs the json_schema field ({name, schema})")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_schema":
            assert self.json_schema is not None  # _schema_given
            if self.json_schema.schema_ is None:  # optional, as at OpenAI and in vLLM
                return GrammarSpec("json_object", param="response_format")
            return GrammarSpec(
                "json_schema", json.dumps(self.json_schema.schema_), param="response_format"
            )
        if self.type == "json_object":
            return GrammarSpec("json_object", param="response_format")
        return None


class _SamplingFields(_Bootstrap):
    model: Text | None = None
    max_tokens: Annotated[Int, engine_bounds("max_tokens")] | None = None
    temperature: (
        Annotated[Float, engine_bounds("temperature"), Field(le=OPENAI_MAX_TEMPERATURE)] | None
    ) = None
    top_p: Annotated[Float, engine_bounds("top_p")] | None = None
    top_k: Annotated[Int, engine_bounds("top_k")] | None = None
    min_p: Annotated[Float, engine_bounds("min_p")] | None = None
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool = False
    presence_penalty: Annotated[Float, engine_bounds("presence_penalty")] | None = None
    frequency_penalty: Annotated[Float, engine_bounds("frequency_penalty")] | None = None
    repetition_penalty: Annotated[Float, engine_bounds("repetition_penalty")] | None = None
    skip_special_tokens: Bool = True
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # SGLang's constraints, as its OpenAI routes take them (the OpenAI SDK's extra_body)
    regex: Text | None = None
    json_schema: JsonText | None = None  # the schema as text
    ebnf: Text | None = None
    logit_bias: LogitBias = None
    modalities: Annotated[list[str] | None, unsupported_unless(None, ["text"])] = None
    audio: Annotated[dict[str, Any] | None, unsupported_unless(None)] = None
    # the matched stop string ends the text: vLLM's name, and SGLang's
    include_stop_str_in_output: Bool = False
    no_stop_trim: Bool = False
    # vLLM's: no end before this many tokens
    min_tokens: Annotated[Int, engine_bounds("min_tokens")] = 0
    # vLLM's guided decoding, not implemented here: SGLang's fields do the same
    guided_json: Annotated[Any, unsupported_unless(None, instead="response_format")] = None
    guided_regex: Annotated[Any, unsupported_unless(None, instead="regex")] = None
    guided_grammar: Annotated[Any, unsupported_unless(None, instead="ebnf")] = None
    guided_choice: Annotated[Any, unsupported_unless(None, instead="regex")] = None
    structured_outputs: Annotated[
        Any, unsupported_unless(None, instead="response_format, regex or ebnf")
    ] = None
    # vLLM's and SGLang's extensions that would change the answer, not implemented here
    bad_words: Annotated[Any, unsupported_unless(None, [])] = None
    allowed_token_ids: Annotated[Any, unsupported_unless(None)] = None
    use_beam_search: Annotated[Any, unsupported_unless(None, False)] = None
    truncate_prompt_tokens: Annotated[Any, unsupported_unless(None)] = None
    stop_regex: Annotated[Any, unsupported_unless(None, [])] = None
    lora_path: Annotated[Any, unsupported_unless(None)] = None
    return_tokens_as_token_ids: Annotated[Any, unsupported_unless(None, False)] = None
    return_token_ids: Annotated[Any, unsupported_unless(None, False)] = None
    return_hidden_states: Annotated[Any, unsupported_unless(None, False)] = None
    prompt_logprobs: Annotated[Any, unsupported_unless(None)] = None  # vLLM's 0: the token's own
    length_penalty: Annotated[Any, unsupported_unless(None, 1, 1.0)] = None
    spaces_between_special_tokens: Annotated[Any, unsupported_unless(None, True)] = None
    logits_processors: Annotated[Any, unsupported_unless(None, [])] = None
    priority: Annotated[Any, unsupported_unless(None, 0)] = None
    # a prefix cache kept apart per salt: a silent no-op would share it across tenants
    cache_salt: Annotated[Any, unsupported_unless(None, "")] = None
    kv_transfer_params: Annotated[Any, unsupported_unless(None)] = None
    vllm_xargs: Annotated[Any, unsupported_unless(None, {})] = None

    @field_validator("stream_options")
    @classmethod
    def _needs_a_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("needs_stream", "needs stream set to true")
        return value

    @field_validator(*SGLANG_GRAMMAR_FIELDS)
    @classmethod
    def _one_constraint(cls, value: str | None, info: ValidationInfo) -> str | None:
        given = [kind for kind in SGLANG_GRAMMAR_FIELDS if info.data.get(kind) is not None]
        response_format = info.data.get("response_format")
        if response_format is not None and response_format.type != "text":
            given.insert(0, "response_format")
        if value is not None and given:
            raise PydanticCustomError(
                "one_constraint",
                "cannot constrain the answer together with {given}",
                {"given": " and ".join(given)},
            )
        return value

    def grammar(self) -> GrammarSpec | None:
        """What the answer is constrained to: response_format, regex, json_schema or ebnf
        (at most one is given)."""
        if (grammar := _sglang_grammar(self)) is not None:
            return grammar
        return self.response_format.grammar() if self.response_format is not None else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = SamplingParams()
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            logit_bias=logit_bias_by_id(self.logit_bias),
            grammar=self.grammar(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _text_only(kind: str) -> str:
    """A part of another kind (an image, audio, a file) is refused in words that say why, not
    pydantic's "Input should be 'text'": the engine serves text models."""
    if kind != "text":
        raise PydanticCustomError(
            "text_only",
            "{kind} content is not supported by this server: it takes text parts only",
            {"kind": kind},
        )
    return kind


class TextPart(_Lenient):
    type: Annotated[Text, AfterValidator(_text_only)]
    text: Text


class FunctionCall(_Lenient):
    name: Text
    arguments: Text  # JSON text


class MessageToolCall(_Lenient):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's answer: to which call
    name: Text | None = None  # OpenAI's participant name: the template may write it, as vLLM's do

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        """What OpenAI requires of each role: content, except from an assistant that called
        tools; a tool's answer says which call it answers."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            needs = "content or tool_calls" if self.role == "assistant" else "content"
            raise PydanticCustomError("incomplete_message", f"{self.role} messages need {needs}")
        if self.content == []:
            raise PydanticCustomError("incomplete_message", "content is an empty list of parts")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError(
                "incomplete_message", "tool messages need tool_call_id (the call they answer)"
            )
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.tool_calls:  # templates render arguments as an object (Hugging Face's convention)
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _json_or_text(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionSpec(_Lenient):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: JsonObject | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


def _named_once(value: list[Tool] | None) -> list[Tool] | None:
    names = [tool.function.name for tool in value or ()]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise PydanticCustomError(
            "tool_named_twice",
            "name each function once; more than one is named {names}",
            {"names": ", ".join(twice)},
        )
    return value


Tools = Annotated[list[Tool] | None, AfterValidator(_named_once)]
"""A chat's `tools`, each function named once."""


def _continues_an_assistant(value: bool, info: ValidationInfo) -> bool:
    if not value:
        return value
    if info.data.get("add_generation_prompt"):
        raise PydanticCustomError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    messages = info.data.get("messages")
    if messages and messages[-1].role != "assistant":
        raise PydanticCustomError(
            "continue_final_message",
            "needs the last message to be the assistant's, got {role}",
            {"role": messages[-1].role},
        )
    return value


ContinueFinalMessage = Annotated[Bool, AfterValidator(_continues_an_assistant)]
"""vLLM's and SGLang's `continue_final_message`: the answer goes on from the last message, the
assistant's (after `messages` and `add_generation_prompt` in a body, which it checks)."""


class NamedFunction(_Lenient):
    name: Text


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, engine_bounds("max_tokens")] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, engine_bounds("logprobs")] | None = None
    tools: Tools = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    # OpenAI's deprecated forms of tools and tool_choice
    functions: Annotated[
        list[dict[str, Any]] | None, unsupported_unless(None, [], instead="tools")
    ] = None
    function_call: Annotated[
        str | dict[str, Any] | None, unsupported_unless(None, "none", instead="tool_choice")
    ] = None
    # OpenAI's options this server does not implement (a reasoning model's effort, the
    # answer's verbosity, web search, predicted outputs, moderation of the input and output):
    # refused unless they ask for nothing
    reasoning_effort: Annotated[str | None, unsupported_unless(None)] = None
    verbosity: Annotated[str | None, unsupported_unless(None)] = None
    web_search_options: Annotated[dict[str, Any] | None, unsupported_unless(None)] = None
    prediction: Annotated[dict[str, Any] | None, unsupported_unless(None)] = None
    moderation: Annotated[dict[str, Any] | None, unsupported_unless(None)] = None
    # vLLM's and SGLang's control of the chat template
    add_generation_prompt: Bool = True  # the prompt ends with the start of an assistant turn
    continue_final_message: ContinueFinalMessage = False
    chat_template_kwargs: JsonObject | None = None  # more variables for the template
    chat_template: Annotated[Any, unsupported_unless(None)] = None  # the model's own only
    documents: Annotated[Any, unsupported_unless(None, [])] = None
    mm_processor_kwargs: Annotated[Any, unsupported_unless(None, {})] = None

    @field_validator("top_logprobs")
    @classmethod
    def _asks_for_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("needs_logprobs", "needs logprobs set to true")
        return value

    def tool_mode(self) -> ToolChoice:
        """tool_choice as it applies to this request's tools; InvalidRequestError where
        tool_choice and tools disagree."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none":
            return ToolChoice("none")
        if not self.tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if (grammar := self.grammar()) is not None and choice != "auto":
            raise InvalidRequestError(
                f"{grammar.param} and a required or named tool_choice cannot both "
                "constrain the answer",
                param="tool_choice",
            )
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools)
        if isinstance(choice, NamedToolChoice):
            named = next((t for t in tools if t["function"]["name"] == choice.function.name), None)
            if named is None:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
            return ToolChoice("named", named, tools)
        return ToolChoice(choice, None, tools)

    def renamed_fields(self) -> Mapping[str, str]:
        """The client's names of the engine's fields, where they differ, for errors."""
        given = self.max_completion_tokens is not None
        return {"max_tokens": "max_completion_tokens"} if given else {}

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(
            self.max_completion_tokens or self.max_tokens,
            (self.top_logprobs or 0) if self.logprobs else None,
        )


class CompletionRequest(_SamplingFields):
    prompt: Text | PromptList
    logprobs: Annotated[Int, engine_bounds("logprobs")] | None = None
    max_tokens: Annotated[Int, engine_bounds("max_tokens")] | None = 16  # OpenAI's default
    echo: Annotated[Bool, unsupported_unless(False)] = False
    best_of: Annotated[Int | None, unsupported_unless(None, 1, instead="n")] = None
    suffix: Annotated[str | None, unsupported_unless(None, "")] = None

    def prompts(self) -> list[str] | list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # one prompt given as token ids
        # a list of strings or of token id lists (mypy does not narrow a list by its first item)
        return cast(list[str] | list[list[int]], list(p))

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TokenizeRequestBody(_Lenient):
    """vLLM's /tokenize: a completion's `prompt`, or chat `messages` with the chat route's
    control of the template, so that the tokens are those of a request with that prompt."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Tools = None
    add_generation_prompt: Bool = True
    continue_final_message: ContinueFinalMessage = False
    chat_template_kwargs: JsonObject | None = None
    # unset: vLLM's defaults, a prompt's yes and messages' no (their template writes them)
    add_special_tokens: Bool | None = None
    return_token_strs: Annotated[Bool | None, unsupported_unless(None, False)] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequestBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequestBody(_Lenient):
    """vLLM's /detokenize."""

    model: Text | None = None
    tokens: list[TokenId]


class NativeSamplingParams(_Lenient):
    max_new_tokens: Annotated[Int, engine_bounds("max_tokens")] | None = 128
    temperature: Annotated[Float, engine_bounds("temperature")] = 1.0
    top_p: Annotated[Float, engine_bounds("top_p")] = 1.0
    top_k: Annotated[Int, engine_bounds("top_k")] = -1
    min_p: Annotated[Float, engine_bounds("min_p")] = 0.0
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool = False
    presence_penalty: Annotated[Float, engine_bounds("presence_penalty")] = 0.0
    frequency_penalty: Annotated[Float, engine_bounds("frequency_penalty")] = 0.0
    repetition_penalty: Annotated[Float, engine_bounds("repetition_penalty")] = 1.0
    skip_special_tokens: Bool = True
    no_stop_trim: Bool = False  # the matched stop string ends the text
    # SGLang's constraints on the output, at most one: a regex, a JSON schema (as text), an EBNF grammar
    regex: Text | None = None
    json_schema: JsonText | None = None
    ebnf: Text | None = None
    # no end before this many tokens
    min_new_tokens: Annotated[Int, engine_bounds("min_tokens")] = 0
    n: Int = 1  # SGLang's parallel sampling, which this route does not do
    # SGLang's, that would change the answer: not implemented here
    stop_regex: Annotated[Any, unsupported_unless(None, [])] = None
    logit_bias: LogitBias = None

    @field_validator("n")
    @classmethod
    def _one_sequence(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError(
                "one_sequence",
                "/generate answers one sequence per prompt, got {value}; "
                "ask /v1/completions with n for more",
                {"value": value},
            )
        return value

    @field_validator("min_new_tokens")
    @classmethod
    def _min_new_tokens_can_be_met(cls, value: int, info: ValidationInfo) -> int:
        """In this body's own names (SamplingParams would say min_tokens and max_tokens)."""
        most = info.data.get("max_new_tokens")
        if most is not None and value > most:
            raise PydanticCustomError(
                "min_above_max",
                "must not exceed max_new_tokens ({most}), got {value}",
                {"most": most, "value": value},
            )
        if value and any(info.data.get(kind) is not None for kind in SGLANG_GRAMMAR_FIELDS):
            raise PydanticCustomError(
                "min_with_grammar",
                "cannot be given with regex, json_schema or ebnf: the grammar decides where "
                "the answer ends",
            )
        return value

    @model_validator(mode="after")
    def _one_grammar(self) -> NativeSamplingParams:
        given = [kind for kind in SGLANG_GRAMMAR_FIELDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of regex, json_schema and ebnf, got {' and '.join(given)}"
            )
        return self

    def grammar(self) -> GrammarSpec | None:
        return _sglang_grammar(self, "sampling_params.")


def _sglang_grammar(fields: BaseModel, param_prefix: str = "") -> GrammarSpec | None:
    """The constraint given in SGLang's regex, json_schema or ebnf field, if any; errors name
    the field under `param_prefix`."""
    for kind in SGLANG_GRAMMAR_FIELDS:
        if (spec := getattr(fields, kind)) is not None:
            return GrammarSpec(kind, spec, param=f"{param_prefix}{kind}")
    return None


# The engine's fields as /generate's body names them: the sampling options inside
# `sampling_params`, some under SGLang's names
_NATIVE_FIELD_NAMES: Mapping[str, str] = MappingProxyType(
    {
        **{name: f"sampling_params.{name}" for name in NativeSamplingParams.model_fields},
        "max_tokens": "sampling_params.max_new_tokens",
        "min_tokens": "sampling_params.min_new_tokens",
        "include_stop_str_in_output": "sampling_params.no_stop_trim",
        "logprobs": "top_logprobs_num",
    }
)


class GenerateRequestBody(_Bootstrap):
    """SGLang's native request. The bootstrap fields belong to prefill/decode serving."""

    text: Text | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: Bool = False
    rid: Text | None = None
    return_logprob: Bool = False
    top_logprobs_num: Annotated[Int, engine_bounds("logprobs")] = 0
    # SGLang's inputs and adapters of a request, which would change the answer: a text model
    # without LoRA serves here, so they are refused, not ignored
    lora_path: Annotated[Any, unsupported_unless(None)] = None
    image_data: Annotated[Any, unsupported_unless(None)] = None
    audio_data: Annotated[Any, unsupported_unless(None)] = None
    video_data: Annotated[Any, unsupported_unless(None)] = None
    input_embeds: Annotated[Any, unsupported_unless(None)] = None
    custom_logit_processor: Annotated[Any, unsupported_unless(None)] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequestBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty")
        return self

    def renamed_fields(self) -> Mapping[str, str]:
        """The client's names of the engine's fields, for errors."""
        return _NATIVE_FIELD_NAMES

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        return SamplingParams(
            max_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.seed,
            stop=stop,
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            min_tokens=sp.min_new_tokens,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            logit_bias=logit_bias_by_id(sp.logit_bias),
            grammar=sp.grammar(),
        )
