"""Per-request sampling and stopping options (the names OpenAI, vLLM and SGLang use)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kubesgl.bounds import Bounds

GREEDY_TEMPERATURE = 1e-5

# OpenAI's bound of a logit_bias value: -100 bans a token in effect, 100 all but forces it
LOGIT_BIAS_BOUND = 100
# Tokens one logit_bias may name: every step of the request joins its entries (built once, as
# tensors, when it arrives: Req.bias) into the batch's, copies them to the device and adds
# them, so a bias over a whole vocabulary (150k entries) would slow every request it runs with
LOGIT_BIAS_MAX_TOKENS = 1024

# The limits of each numeric sampling field, the same on every route and in the offline LLM:
# SamplingParams.validate holds a request to them, and the request bodies
# (engine/server/protocol.py) take theirs from here, under their own names. Penalties in
# [-2, 2] as OpenAI, vLLM and SGLang bound them; temperature uncapped, as SGLang's /generate
# takes it (the OpenAI routes add OpenAI's cap of 2 in protocol.py).
SAMPLING_BOUNDS: Mapping[str, Bounds] = MappingProxyType(
    {
        "max_tokens": Bounds(ge=1),
        "min_tokens": Bounds(ge=0),
        "temperature": Bounds(ge=0),
        "top_p": Bounds(gt=0, le=1),
        "top_k": Bounds(ge=-1),  # -1 and 0: no top-k cut
        "min_p": Bounds(ge=0, le=1),
        "repetition_penalty": Bounds(gt=0),  # vLLM's; SGLang's newest caps it at 2
        "presence_penalty": Bounds(ge=-2, le=2),
        "frequency_penalty": Bounds(ge=-2, le=2),
        "logprobs": Bounds(ge=0, le=20),
    }
)


# OpenAI's error code for a request that does not fit the model's context: clients that trim
# a conversation when it outgrows the context look for it
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; the message names the offending field."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param = param
        self.status = status  # 409 for a conflict with a running request, else 400
        self.code = code  # OpenAI's error code, where it has one


def check_prompt_tokens(context_length: int, tokens: int, param: str = "prompt") -> None:
    """Refuses a prompt that leaves no room in the context for one output token (the API
    server asks before tokenizing a token-id prompt, the scheduler for every request)."""
    if tokens >= context_length:
        raise InvalidRequestError(
            f"the prompt is {tokens} tokens long; this model's context length is {context_length}",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def is_utf8(text: str) -> bool:
    """False for text no tokenizer can encode: a lone surrogate ("\ud800", half an emoji)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")
# SGLang's sampling-parameter fields that constrain the output, each a kind of its own
SGLANG_GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output: a JSON schema (text), any JSON object, a regex or an EBNF
    grammar. `param` names the request field it came from, for errors; it is not part of the
    grammar, so two requests with one schema share its compilation."""

    kind: str  # one of GRAMMAR_KINDS
    spec: str = ""  # the schema, regex or grammar; empty for json_object
    param: str = field(default="response_format", compare=False)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the end of the context (the server's default)
    # no end before this many tokens: the tokens that would end it (its stop tokens, EOS) are
    # not sampled, and no stop string counts, until then (vLLM's min_tokens, SGLang's
    # min_new_tokens)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; the matched one is cut off
    include_stop_str_in_output: bool = False  # unless this: the text ends with the one matched
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: added to these tokens' logits before sampling (after penalties)
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = (
        None  # constrained decoding: every output token keeps the text valid
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, as OpenAI and vLLM take it
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        # A temperature this small is greedy in effect, and dividing by it would overflow.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param=param)

        # Types first (a SamplingParams built in Python has had no request model check them),
        # so that the range checks below and the step itself only ever see the right types.
        for name in _NUMBERS:
            value = getattr(self, name)
            check(_is_number(value), name, f"must be a number, got {value!r}")
        for name in _OPTIONAL_INTS:
            value = getattr(self, name)
            check(value is None or _is_int(value), name, f"must be an integer, got {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            check(_is_int(value), name, f"must be an integer, got {value!r}")
        for name in _FLAGS:
            value = getattr(self, name)
            check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        check(
            isinstance(self.stop_token_ids, list) and all(map(_is_int, self.stop_token_ids)),
            "stop_token_ids",
            f"must be a list of token ids, got {self.stop_token_ids!r}",
        )
        check(isinstance(self.stop, list), "stop", f"must be a list of strings, got {self.stop!r}")
        if self.grammar is not None:
            check(
                isinstance(self.grammar.spec, str),
                self.grammar.param,
                f"must be given as text (a JSON schema serialized), got {type(self.grammar.spec).__name__}",
            )
        for name, bounds in SAMPLING_BOUNDS.items():
            value = getattr(self, name)  # a number, or None for no limit or no logprobs
            check(
                value is None or bounds.holds(value),
                name,
                f"must be {bounds.describe()}, got {value}",
            )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        check(
            self.min_tokens == 0 or self.grammar is None,
            "min_tokens",
            "cannot be given with a constraint on the answer (response_format, regex, "
            "json_schema, ebnf, or a required or named tool_choice): its grammar decides where "
            "the answer ends",
        )
        check(
            all(isinstance(x, str) and x for x in self.stop), "stop", "must hold non-empty strings"
        )
        check(
            all(is_utf8(x) for x in self.stop),
            "stop",
            "must be valid UTF-8 text (a lone surrogate is not)",
        )
        check(len(self.stop) <= 16, "stop", f"may hold at most 16 strings, got {len(self.stop)}")
        if self.grammar is not None:
            check(
                self.grammar.kind in GRAMMAR_KINDS,
                self.grammar.param,
                f"kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.grammar.kind!r}",
            )
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        check(
            not bad_ids,
            "stop_token_ids",
            f"contains ids outside the vocabulary (size {vocab_size}): {bad_ids}",
        )
        self._validate_logit_bias(vocab_size, check)

    def _validate_logit_bias(
        self, vocab_size: int, check: Callable[[bool, str, str], None]
    ) -> None:
        bias = self.logit_bias
        check(isinstance(bias, dict), "logit_bias", f"must map token ids to numbers, got {bias!r}")
        check(
            len(bias) <= LOGIT_BIAS_MAX_TOKENS,
            "logit_bias",
            f"may name at most {LOGIT_BIAS_MAX_TOKENS} tokens, got {len(bias)}",
        )
        bad_ids = [t for t in bias if not (_is_int(t) and 0 <= t < vocab_size)]
        check(
            not bad_ids,
            "logit_bias",
            f"has token ids outside the vocabulary (size {vocab_size}): {bad_ids}",
        )
        check(
            all(_is_number(v) and abs(v) <= LOGIT_BIAS_BOUND for v in bias.values()),
            "logit_bias",
            f"values must be numbers from -{LOGIT_BIAS_BOUND} to {LOGIT_BIAS_BOUND}",
        )


_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_OPTIONAL_INTS = ("max_tokens", "seed", "logprobs")
_INTS = ("min_tokens", "top_k")
_FLAGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
