"""Page allocator for the KV pool.

The pool is a flat array of token slots grouped into pages of `page_size` slots; slot s
lives in page s // page_size. Page 0 is never handed out: padded tokens (CUDA-graph
padding, idle rows) write their KV there. Freeing a page that is already free raises, so
double releases show up where they happen instead of as corrupted KV later.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVAllocationError(RuntimeError):
    pass


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens from a page boundary (the last one maybe part full)."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(
                "the KV pool needs at least two pages (page 0 is reserved for padding)"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._is_free = bytearray(num_pages)
        for page in self._free:
            self._is_free[page] = 1

    @property
    def total_pages(self) -> int:
        """Pages that can ever be handed out (the padding page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int]:
        if count > len(self._free):
            raise KVAllocationError(f"asked for {count} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            if page <= 0 or page >= self.num_pages:
                raise KVAllocationError(f"page {page} is not in the pool")
            if self._is_free[page]:
                raise KVAllocationError(f"page {page} freed twice")
            self._is_free[page] = 1
            self._free.append(page)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def pages_of(self, slots: Sequence[int]) -> list[int]:
        """The pages of `slots`, a run of whole pages' slots (or a last page part full)."""
        return [slot // self.page_size for slot in slots[:: self.page_size]]

    def slots_of(self, pages: Iterable[int]) -> list[int]:
        size = self.page_size
        return [page * size + offset for page in pages for offset in range(size)]
