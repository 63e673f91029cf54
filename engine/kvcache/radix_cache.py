"""Radix tree over token ids whose nodes own the KV slots of their tokens.

With a page size above one, every key is a whole number of pages: matches and inserts are
cut down to page boundaries and children are keyed by their first page. A node in use by a
running request is locked (reference counted along its path to the root) and cannot be
evicted; unlocked leaves are evicted least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from kubesgl.engine.kvcache.allocator import PageAllocator

_clock = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: list[int]
    slots: list[int]
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def touch(self) -> None:
        self.last_access = next(_clock)


def _parent(node: TreeNode) -> TreeNode:
    assert node.parent is not None  # every node but the root has one
    return node.parent


@dataclass(frozen=True)
class PrefixMatch:
    slots: list[int]
    node: TreeNode


class CacheIntegrityError(AssertionError):
    pass


class RadixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = TreeNode(key=[], slots=[], lock_ref=1)  # the root is never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes (the root excluded)

    # -- lookups -----------------------------------------------------------------------
    def _page_key(self, tokens: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _common_len(self, key: list[int], tokens: list[int], start: int) -> int:
        """Page-aligned length of the common prefix of `key` and `tokens[start:]`. Slices are
        compared (in C), bisecting on a mismatch: a token-by-token loop costs ~32 ms per step
        when --schedule-policy lpm matches 128 waiting prompts of 4096 tokens."""
        limit = min(len(key), len(tokens) - start)
        if key[:limit] == tokens[start : start + limit]:
            n = limit
        else:
            n, mismatch = 0, limit  # key[:n] matches; key[:mismatch] does not
            while mismatch - n > 1:
                mid = (n + mismatch) // 2
                if key[n:mid] == tokens[start + n : start + mid]:
                    n = mid
                else:
                    mismatch = mid
        return n - n % self.page_size

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached, page-aligned prefix of `tokens` and the node where it ends."""
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, pos, slots = self.root, 0, []
        node.touch()
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.touch()
            slots += child.slots
            pos += n
            node = child
        return PrefixMatch(slots=slots, node=node)

    def peek_prefix(self, tokens: list[int]) -> tuple[int, TreeNode]:
        """Length of the longest cached, page-aligned prefix of `tokens`, and the deepest node
        it covers whole; unlike `match_prefix`, changes nothing (no split, no LRU touch)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None or len(tokens) - pos < self.page_size:
                break
            n = self._common_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos, node

    # -- updates -----------------------------------------------------------------------
    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new upper part."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = TreeNode(
            key=node.key[:at],
            slots=node.slots[:at],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        parent.children[self._page_key(upper.key)] = upper
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], upper
        upper.children[self._page_key(node.key)] = node
        return upper

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Add `tokens` (page-aligned) with their KV `slots`. Returns how many leading tokens
        were already cached: the caller's slots for those are duplicates it must free."""
        assert len(tokens) == len(slots) and len(tokens) % self.page_size == 0
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                leaf = TreeNode(key=tokens[pos:], slots=slots[pos:], parent=node)
                leaf.touch()
                node.children[self._page_key(leaf.key)] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = self._common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.touch()
            pos += n
            node = child
        return pos

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = _parent(node)

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise CacheIntegrityError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = _parent(node)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens of unlocked leaves, least recently used first."""
        heap = [
            (n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self.allocator.free(self.allocator.pages_of(leaf.slots))
            del parent.children[self._page_key(leaf.key)]
            self.evictable_size -= len(leaf.key)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> None:
        """Evict everything that is not locked."""
        self.evict(self.evictable_size)

    # -- inspection --------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_pages(self) -> list[int]:
        return [page for n in self._nodes() for page in self.allocator.pages_of(n.slots)]

    def check_integrity(self, locked_nodes: list[TreeNode]) -> None:
        """Walk the tree and check it against the nodes live requests hold locks on."""
        expected: Counter[int] = Counter()
        for node in locked_nodes:
            while node is not self.root:
                expected[id(node)] += 1
                node = _parent(node)
        evictable = protected = 0
        for node in self._nodes():
            if node.lock_ref != expected[id(node)]:
                raise CacheIntegrityError(
                    f"node holds {node.lock_ref} locks, live requests hold {expected[id(node)]}"
                )
            if len(node.key) != len(node.slots) or not node.key or len(node.key) % self.page_size:
                raise CacheIntegrityError("node key and slots disagree or are not page-aligned")
            if _parent(node).children.get(self._page_key(node.key)) is not node:
                raise CacheIntegrityError(
                    "node is not reachable from its parent under its first page"
                )
            for i in range(0, len(node.slots), self.page_size):
                page = node.slots[i] // self.page_size
                if node.slots[i : i + self.page_size] != list(
                    range(page * self.page_size, (page + 1) * self.page_size)
                ):
                    raise CacheIntegrityError("node slots do not cover whole pages")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise CacheIntegrityError(
                f"counted evictable/protected {evictable}/{protected}, "
                f"recorded {self.evictable_size}/{self.protected_size}"
            )


class NoPrefixCache(RadixCache):
    """The prefix cache of --disable-radix-cache: a tree that keeps nothing. Every match is
    empty and every insert is refused, so a request's KV stays its own and is freed with it."""

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        return PrefixMatch(slots=[], node=self.root)

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        return 0
