"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens and taking what the newest tokens
added, so each step costs the same however long the output is. Two things are held back
until they are settled: text ending in an incomplete UTF-8 character (a multi-byte
character split over tokens decodes to U+FFFD until its last byte arrives), and a tail that
could be the start of a stop string, so that no part of a stop string ever reaches a
client. When the request ends on a stop string, the text is cut where it begins; when it
ends on a token (a stop token, EOS, a grammar's end), that token adds no text.

Stop strings are found by an Aho-Corasick automaton (`StopMatcher`) that reads each new
character once: the work of a step grows with the text it adds, not with the output so far
nor with the length of the stop strings. The scheduler finds stop strings the same way
(scheduler/stop_strings.py), from the same settled text, so that both agree on where a
stop string ends the output.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubesgl.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Tokens that may wait for the rest of a character split over them. A character is at most
# four bytes, so valid text settles within a few tokens; output that keeps ending in U+FFFD
# longer is bytes that are no UTF-8 (a model can emit them), and waiting for it would decode
# an ever longer window at each step.
MAX_PENDING_TOKENS = 64


class StopMatcher:
    """An Aho-Corasick automaton over a request's stop strings. A state stands for the
    longest tail of the text read so far that begins some stop string (`held(state)`
    characters); reading a character costs amortized constant time. Nodes are kept in arrays,
    about 32 bytes each: 16 stop strings of 1024 characters take about 0.5 MB and 20 ms to
    build, where a dict per node would take megabytes."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(stop for stop in stops if stop)
        # Edges: a node with one child keeps it in _char/_child (code point, node); a node with
        # several, in _branches[node] ({code point: node}). _parent/_in_char: the edge into a node.
        self._char, self._child = array("i", [-1]), array("i", [-1])
        self._branches: dict[int, dict[int, int]] = {}
        self._parent, self._in_char = array("i", [0]), array("i", [-1])
        self._depth = array("i", [0])
        self._match = array(
            "i", [-1]
        )  # the longest stop string (its index) the node's text ends with
        for index, stop in enumerate(self._stops):
            codes = array("i", map(ord, stop))
            node, known = 0, 0
            while known < len(codes) and (child := self._goto(node, codes[known])) >= 0:
                node, known = child, known + 1
            if known < len(codes):  # the rest of the stop string is a chain of new nodes
                first, count = len(self._depth), len(codes) - known
                self._add_edge(node, codes[known], first)
                self._char.extend(codes[known + 1 :])
                self._char.append(-1)
                self._child.extend(range(first + 1, first + count))
                self._child.append(-1)
                self._parent.append(node)
                self._parent.extend(range(first, first + count - 1))
                self._in_char.extend(codes[known:])
                self._depth.extend(range(self._depth[node] + 1, self._depth[node] + 1 + count))
                self._match.extend(array("i", [-1]) * count)
                node = first + count - 1
            if self._match[node] < 0:
                self._match[node] = index
        self._fail = array("i", bytes(4 * len(self._depth)))
        self._link_all()

    def _link_all(self) -> None:
        """Failure links, shallowest nodes first: a node's link and those it is found through
        are shallower, so final already."""
        fail, parent, in_char, match = self._fail, self._parent, self._in_char, self._match
        char, child, branches = self._char, self._child, self._branches
        for node in sorted(range(1, len(self._depth)), key=self._depth.__getitem__):
            up = parent[node]
            if up == 0:
                continue  # one character deep: the root
            code, link = in_char[node], fail[up]
            while True:
                edges = branches.get(link)
                found = (
                    edges.get(code, -1)
                    if edges is not None
                    else (child[link] if char[link] == code else -1)
                )
                if found >= 0 or link == 0:
                    break
                link = fail[link]
            fail[node] = max(found, 0)
            if match[node] < 0:
                match[node] = match[fail[node]]

    def _goto(self, node: int, code: int) -> int:
        branches = self._branches.get(node)
        if branches is not None:
            return branches.get(code, -1)
        return self._child[node] if self._char[node] == code else -1

    def _add_edge(self, node: int, code: int, child: int) -> None:
        if node in self._branches:
            self._branches[node][code] = child
        elif self._child[node] < 0:
            self._char[node], self._child[node] = code, child
        else:
            self._branches[node] = {self._char[node]: self._child[node], code: child}
            self._char[node] = self._child[node] = -1

    @property
    def size(self) -> int:
        return len(self._depth)

    def _step(self, state: int, char: str) -> int:
        code = ord(char)
        while True:
            child = self._goto(state, code)
            if child >= 0:
                return child
            if state == 0:
                return 0
            state = self._fail[state]

    def advance(self, state: int, text: str) -> int:
        """The state after reading `text`."""
        for char in text:
            state = self._step(state, char)
        return state

    def find(self, state: int, text: str) -> tuple[int, str | None, int]:
        """Reads `text` up to the first character that completes a stop string: the state
        there, that stop string (the longest one ending there) or None, and the characters
        read."""
        for read, char in enumerate(text, 1):
            state = self._step(state, char)
            if self._match[state] >= 0:
                return state, self._stops[self._match[state]], read
        return state, None, len(text)

    def held(self, state: int) -> int:
        """Characters at the end of the text read that are, or begin, a stop string."""
        return self._depth[state]


def _match_end(text: str, starts_at: int, stop: str, end: int | None) -> int | None:
    """Where in `text` (which starts at character `starts_at` of the output) the counted match
    of `stop` ends: at `end` when given, else after its first occurrence."""
    if end is not None:
        end -= starts_at
        if len(stop) <= end <= len(text) and text[:end].endswith(stop):
            return end
    at = text.find(stop)
    return at + len(stop) if at >= 0 else None


@functools.lru_cache(maxsize=8)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """One automaton for the copies of a request (n, several prompts) that share stop strings."""
    return StopMatcher(stops)


@dataclass
class DecodeState:
    skip_special_tokens: bool
    stop: list[str]
    # a matched stop string or stop token ends the text (vLLM's include_stop_str_in_output)
    include_stop: bool = False
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens before this were turned into text
    held: str = ""  # settled text not handed out yet: a tail that could begin a stop string
    settled_chars: int = 0  # characters of text settled so far
    stop_state: int = 0  # the stop matcher's state after all settled text
    matcher: StopMatcher | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.matcher = stop_matcher(tuple(self.stop)) if self.stop else None

    @property
    def holds_text(self) -> bool:
        """Text of tokens already taken is still to come: a character not yet whole, or a
        tail that could begin a stop string."""
        return self.read_offset < len(self.token_ids) or bool(self.held)

    @classmethod
    def of(cls, params: SamplingParams) -> DecodeState:
        """The decoding of a request's output, as its sampling options ask for it."""
        return cls(
            skip_special_tokens=params.skip_special_tokens,
            stop=list(params.stop),
            include_stop=params.include_stop_str_in_output,
        )


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int], state: DecodeState) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=state.skip_special_tokens)

    def settle(self, state: DecodeState, new_ids: list[int], finished: bool) -> str:
        """Add tokens; returns the text they settled (possibly that of earlier tokens too)."""
        state.token_ids += new_ids
        before = self._decode(state.token_ids[state.prefix_offset : state.read_offset], state)
        full = self._decode(state.token_ids[state.prefix_offset :], state)
        grew = len(full) > len(before)
        pending = len(state.token_ids) - state.read_offset
        if (
            finished
            or pending > MAX_PENDING_TOKENS
            or (grew and not full.endswith(REPLACEMENT_CHAR))
        ):
            state.prefix_offset, state.read_offset = state.read_offset, len(state.token_ids)
            settled = full[len(before) :] if grew else ""
            state.settled_chars += len(settled)
            return settled
        return ""  # nothing new yet, or the newest tokens end inside a character: wait for the rest

    def step(
        self,
        state: DecodeState,
        new_ids: list[int],
        finished: bool,
        matched_stop: str | None,
        matched_end: int | None = None,
        matched_token: int | None = None,
    ) -> str:
        """Add tokens; returns the text that may now be sent. `matched_end`: where in the whole
        output text the matched stop string ends (an occurrence before it did not count).
        `matched_token`: the token that ended the request, the last of `new_ids`."""
        if matched_token is not None and not state.include_stop:
            new_ids = new_ids[:-1]  # its text is not part of the answer (as vLLM, SGLang)
        new_text = self.settle(state, new_ids, finished)
        text = state.held + new_text
        if matched_stop is not None:
            # A tail that could begin a stop string was held back, so the match lies in `text`.
            state.held = ""
            end = _match_end(text, state.settled_chars - len(text), matched_stop, matched_end)
            if end is None:
                return text
            return text[:end] if state.include_stop else text[: end - len(matched_stop)]
        if finished or state.matcher is None:
            state.held = ""
            return text
        state.stop_state = state.matcher.advance(state.stop_state, new_text)
        keep = min(state.matcher.held(state.stop_state), len(text))
        state.held = text[len(text) - keep :]
        return text[: len(text) - keep]
