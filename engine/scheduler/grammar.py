"""Grammars for constrained decoding, on xgrammar: compiled off the scheduler's loop, cached by
what they constrain to, and one matcher per request that follows its output tokens."""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar

from kubesgl.engine.messages import GrammarStats
from kubesgl.engine.sampling_params import GRAMMAR_KINDS, GrammarSpec, InvalidRequestError

CACHE_ENTRIES = 512  # compiled grammars kept; a 128k vocabulary makes each tens of kB to a few MB
_ANY_OBJECT = '{"type": "object"}'
# xgrammar's errors start with a timestamp and its source file: "[08:51:28] /project/cpp/x.cc:94: ",
# and so does each error they quote, after their "...: " (a schema nested too deep for its JSON
# reader); text of the client's elsewhere is left as it is
_XGRAMMAR_PREFIX = re.compile(r"(?:^|(?<=: ))\[[\d:]+\] [^:\s]+:\d+: ")
# and a JSON text its reader refused is quoted whole after the error: the client's own, a schema
# of any size, cut off by a plain split (a regex over the client's text, such as a run of
# spaces, can take seconds of the scheduler's loop)
_XGRAMMAR_QUOTE = ". The JSON string is:"
# xgrammar's own words run to about 200 characters; what is longer quotes the client's text
# (a type, a rule's name), which the 400 need not send back whole
_XGRAMMAR_ERROR_CHARS = 300


# How xgrammar 0.2.9 writes the raw characters of a JSON string: a string with minLength or
# maxLength as the first class, which lets control characters in, any other as the second.
# Both let encoded surrogates (U+D800-DFFF) in, which are not UTF-8. Strict JSON refuses either
# (the OpenAI SDK's parse() fails on an answer that holds one, common with maxLength). Swapped in
# the grammar's text for JSON's own class, the bounds stay xgrammar's repetition (as a regex
# `pattern`, a maxLength in the thousands takes seconds to compile). A release that writes other
# classes is left as it is.
_XGRAMMAR_STRING_CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def json_grammar(schema: str, strict: bool = True) -> str:
    """The grammar (EBNF text) the engine compiles for a JSON schema."""
    grammar = str(
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    )
    for character in _XGRAMMAR_STRING_CHARACTERS:
        grammar = grammar.replace(character, _JSON_STRING_CHARACTER)
    return grammar


# How xgrammar compiles each of GRAMMAR_KINDS, given the spec's text.
_COMPILE: dict[str, Callable[[xgrammar.GrammarCompiler, str], xgrammar.CompiledGrammar]] = {
    "json_schema": lambda compiler, schema: compiler.compile_grammar(json_grammar(schema)),
    # OpenAI's JSON mode: an object, of any properties
    "json_object": lambda compiler, _: compiler.compile_grammar(
        json_grammar(_ANY_OBJECT, strict=False)
    ),
    "regex": lambda compiler, regex: compiler.compile_regex(regex),
    "ebnf": lambda compiler, ebnf: compiler.compile_grammar(ebnf),
}
assert set(_COMPILE) == set(GRAMMAR_KINDS)


# Each kind in a message's prose: not its field's name, which the server rewrites into the
# client's (`sampling_params.json_schema`), where the message already names the field.
_KIND_WORDS = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "ebnf": "EBNF grammar",
}
assert set(_KIND_WORDS) == set(GRAMMAR_KINDS)


def _xgrammar_error(message: str) -> str:
    """xgrammar's error, without its timestamps and source files, the JSON text it quotes,
    or more than _XGRAMMAR_ERROR_CHARS characters."""
    error, quoted, _ = message.partition(_XGRAMMAR_QUOTE)
    error = _XGRAMMAR_PREFIX.sub("", error.strip()) + ("." if quoted else "")
    if len(error) > _XGRAMMAR_ERROR_CHARS:
        return error[: _XGRAMMAR_ERROR_CHARS - 3] + "..."
    return error


class UncompilableGrammar(Exception):
    """Why xgrammar cannot compile a grammar. Kept with the grammar, which requests share
    whatever field they gave it in, so it names no field: `refusal` words each request's."""

    def refusal(self, spec: GrammarSpec) -> InvalidRequestError:
        return InvalidRequestError(
            f"{spec.param}: the {_KIND_WORDS[spec.kind]} cannot be compiled: {self}",
            param=spec.param,
        )


class GrammarBackend:
    """Compiles each distinct GrammarSpec once, on worker threads, and keeps the result
    (a CompiledGrammar, or the UncompilableGrammar saying why it cannot be one)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], workers: int = 2):
        self._tokenizer, self._vocab_size, self._stop_token_ids = (
            tokenizer,
            vocab_size,
            stop_token_ids,
        )
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kubesgl-grammar")
        self._cache: OrderedDict[GrammarSpec, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._stats_lock = threading.Lock()
        self.stats = GrammarStats()

    def compile(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            self.stats.cache_hits += 1
            return future
        self.stats.cache_misses += 1
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def take_stats(self) -> GrammarStats:
        with self._stats_lock:
            samples, self.stats.compile_seconds = self.stats.compile_seconds, []
            return GrammarStats(self.stats.cache_hits, self.stats.cache_misses, samples)

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()  # the tokenizer's info is built once, here, off the loop
        start = time.perf_counter()
        try:
            compiled = _COMPILE[spec.kind](compiler, spec.spec)
        except (RuntimeError, ValueError) as exc:
            raise UncompilableGrammar(_xgrammar_error(str(exc))) from None
        with self._stats_lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
