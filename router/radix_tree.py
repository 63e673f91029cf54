"""An approximate radix tree of the text one worker has been sent, bounded in size.

The router cannot see a worker's real KV cache, so it remembers the request texts it routed
there: the longest common prefix between a new request and this tree estimates how much of
the request the worker has cached. Characters stand in for tokens (cheap, tokenizer-free).
When the tree holds more than `max_chars`, the least recently used leaves are evicted until
it is back to 90% of the bound, so eviction runs rarely and costs little per insert.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

# Evict down to this fraction of the bound, so an eviction pass pays for many inserts.
EVICTION_LOW_WATERMARK = 0.9


@dataclass(eq=False, slots=True)
class _Node:
    edge: str
    parent: _Node | None
    last_access: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _common_prefix_length(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of `edge` and `text[pos:]`, given that their first chars match."""
    if text.startswith(edge, pos):
        return len(edge)
    # Binary search over str.startswith keeps the character comparisons in C.
    low, high = 1, min(len(edge), len(text) - pos)
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars <= 0:
            raise ValueError("max_chars must be positive")
        self.max_chars = max_chars
        self._root = _Node("", None)
        self._size = 0
        self._clock = 0  # a counter, not wall time: only the order of accesses matters

    @property
    def size(self) -> int:
        """Characters held (edges of all nodes)."""
        return self._size

    def match_length(self, text: str) -> int:
        """Length of the longest prefix of `text` that this tree holds."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_prefix_length(child.edge, text, pos)
            pos += common
            if common < len(child.edge):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Records `text` as seen now; evicts old leaves when the tree outgrows its bound."""
        self._clock += 1
        now = self._clock
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, now)
                self._size += len(text) - pos
                break
            common = _common_prefix_length(child.edge, text, pos)
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        if self._size > self.max_chars:
            self._evict(int(self.max_chars * EVICTION_LOW_WATERMARK))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cuts `child`'s edge after `at` chars; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:at], parent, child.last_access)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _evict(self, target: int) -> None:
        leaves = [n for n in self._nodes() if not n.children and n is not self._root]
        heap = [(n.last_access, id(n), n) for n in leaves]
        heapq.heapify(heap)
        while heap and self._size > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self._size -= len(leaf.edge)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        nodes, stack = [], [self._root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
