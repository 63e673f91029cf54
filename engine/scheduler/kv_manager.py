"""Who holds which KV pages: admission reservations, growth, radix-cache hand-over, release
and retraction.

Every page is in exactly one place: free in the allocator, owned by the radix tree, or
owned by one live request (its pages past `num_cached`). Admission reserves the pages of a
request's prompt and of the outputs it is expected to generate (admission.py), never more
than the free and evictable pages less the other reservations, so reservations can always be
met. A request that outgrows its reservation takes unreserved pages; when there are none,
the scheduler retracts a request (`retract`) to make room.

With --disable-radix-cache the tree is a `NoPrefixCache`, which keeps nothing: the same code
then frees every request's KV with it.
"""

from __future__ import annotations

from collections.abc import Iterable

from kubesgl.engine.kvcache.allocator import PageAllocator, pages_for
from kubesgl.engine.kvcache.radix_cache import CacheIntegrityError, RadixCache
from kubesgl.engine.scheduler.admission import OutputEstimate
from kubesgl.engine.scheduler.request import Req, ReqStatus


class KVManager:
    def __init__(self, allocator: PageAllocator, radix: RadixCache, num_rows: int):
        self.allocator = allocator
        self.radix = radix
        self.page_size = allocator.page_size
        self.num_rows = num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.reserved_pages = 0
        self.estimate = OutputEstimate()

    # -- capacity ----------------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        """KV tokens the pool can ever hand out (the padding page excluded)."""
        return self.allocator.total_pages * self.page_size

    def available_pages(self) -> int:
        """Pages free or evictable that no reservation has promised."""
        return (
            self.allocator.num_free
            + self.radix.evictable_size // self.page_size
            - self.reserved_pages
        )

    def committed_tokens(self) -> int:
        """KV tokens spoken for: held by requests, locked in the cache, or reserved for the
        outputs of running requests (evictable cache excluded). What admission is bound by."""
        held = (
            self.allocator.total_pages - self.allocator.num_free
        ) * self.page_size - self.radix.evictable_size
        return held + self.reserved_pages * self.page_size

    # -- admission ---------------------------------------------------------------------
    def try_admit(self, req: Req, kv_tokens: int) -> bool:
        """Give `req` a table row, its cached prefix and a reservation for `kv_tokens` KV
        positions in all, or nothing at all."""
        if not self._free_rows:
            return False
        # At least one token is always computed: its logits give the next output.
        match = self.radix.match_prefix(req.fill_ids()[:-1])
        slots, node = match.slots, match.node
        self.radix.lock(node)
        need = pages_for(kv_tokens, self.page_size) - len(slots) // self.page_size
        if need > self.available_pages():
            self.radix.unlock(node)
            return False
        req.row = self._free_rows.pop()
        if not req.retractions:  # a resumed request reports the hit of its first admission
            req.num_prefix_hit = len(slots)
        req.slots, req.num_cached, req.last_node = list(slots), len(slots), node
        req.num_scheduled = req.num_computed = len(slots)
        req.reserved_pages = need
        self.reserved_pages += need
        return True

    def try_admit_for_transfer(self, req: Req, kv_tokens: int) -> bool:
        """Like `try_admit`, for a prompt whose KV another engine writes: no prefix is matched
        (the slots must be this request's own until the write has landed, and a request that
        fails must leave nothing in the tree), and the prompt's slots are allocated at once."""
        if not self._free_rows:
            return False
        need = pages_for(kv_tokens, self.page_size)
        if need > self.available_pages():
            return False
        req.row = self._free_rows.pop()
        req.slots, req.num_cached, req.num_prefix_hit, req.last_node = [], 0, 0, self.radix.root
        req.num_scheduled = req.num_computed = 0
        req.reserved_pages = need
        self.reserved_pages += need
        self.grow(req, req.prompt_len)
        return True

    # -- growth ------------------------------------------------------------------------
    def grow(self, req: Req, num_tokens: int) -> list[int]:
        """KV slots for the next `num_tokens` positions of `req`: from its reservation, then
        from unreserved pages (the scheduler checks `pages_short` first)."""
        p = self.page_size
        room = (-len(req.slots)) % p  # free slots left in the request's last page
        in_page = min(room, num_tokens)
        new = [req.slots[-1] + 1 + i for i in range(in_page)]
        pages_needed = pages_for(num_tokens - in_page, self.page_size)
        if pages_needed:
            unreserved = pages_needed - min(pages_needed, req.reserved_pages)
            if unreserved > self.available_pages():
                raise RuntimeError(
                    f"request {req.rid} outgrew its KV reservation and no page is unreserved"
                )
            shortfall = pages_needed - self.allocator.num_free
            if shortfall > 0:
                self.radix.evict(shortfall * p)
            pages = self.allocator.alloc(pages_needed)
            from_reservation = pages_needed - unreserved
            req.reserved_pages -= from_reservation
            self.reserved_pages -= from_reservation
            new += self.allocator.slots_of(pages)[: num_tokens - in_page]
        req.slots += new
        return new

    def pages_short(self, reqs: list[Req]) -> int:
        """Pages missing for a decode step of `reqs` (one token each) beyond their
        reservations; 0: the step fits."""
        available = self.available_pages()
        if available >= len(reqs):  # at most one page each: the common case costs nothing
            return 0
        p = self.page_size
        unreserved = sum(1 for req in reqs if req.reserved_pages == 0 and len(req.slots) % p == 0)
        return max(0, unreserved - available)

    def reserve_decode_pages(self, reqs: list[Req]) -> None:
        """Reserve the page each of `reqs` takes in its next decode step beyond its reservation,
        so that requests admitted before that step cannot take it. The scheduler checks
        `pages_short(reqs) == 0` first."""
        p = self.page_size
        for req in reqs:
            if req.reserved_pages == 0 and len(req.slots) % p == 0:
                req.reserved_pages = 1
                self.reserved_pages += 1

    # -- hand-over to the radix cache ------------------------------------------------------
    def cache_prefix(self, req: Req) -> None:
        """Put the computed, page-aligned part of the prompt into the tree, so that other
        requests (the n copies of one prompt, say) can share it while this one runs."""
        aligned = min(req.num_computed, req.fill_len) // self.page_size * self.page_size
        if aligned > req.num_cached:
            self._insert(req, req.fill_ids()[:aligned])

    def _insert(self, req: Req, tokens: list[int]) -> None:
        n = len(tokens)
        already_cached = self.radix.insert(tokens, req.slots[:n])
        if already_cached > req.num_cached:
            # Another request cached these tokens first: use its pages, free ours.
            self._free_slots(req.slots[req.num_cached : already_cached])
            req.table_len = min(req.table_len, req.num_cached)
        match = self.radix.match_prefix(tokens)
        cached = len(match.slots)  # n, or 0 where the cache keeps nothing
        self.radix.lock(match.node)
        assert req.last_node is not None  # set at admission, with the row
        self.radix.unlock(req.last_node)
        req.slots[:cached] = match.slots
        req.last_node, req.num_cached = match.node, cached

    # -- release -----------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Return everything `req` holds. Its computed KV stays in the tree for reuse."""
        if req.status is ReqStatus.RELEASED:
            raise RuntimeError(f"request {req.rid} released twice")
        self._give_back(req)
        req.status = ReqStatus.RELEASED

    def retract(self, req: Req) -> None:
        """Take back what a running request holds so that it can be re-admitted later: its
        computed KV goes into the tree, where its re-admission finds it unless evicted meanwhile.
        No step in flight may use `req` (its pages are reused at once)."""
        self._give_back(req)

    def _give_back(self, req: Req) -> None:
        if req.row is not None:
            # KV is only reusable where the token it belongs to is known: an abort can leave
            # the KV of a sampled token that was never appended.
            tokens = req.all_tokens()
            aligned = min(req.num_computed, len(tokens)) // self.page_size * self.page_size
            if aligned > req.num_cached:
                self._insert(req, tokens[:aligned])
            self._free_slots(req.slots[req.num_cached :])
            assert req.last_node is not None  # set at admission, with the row
            self.radix.unlock(req.last_node)
            self.reserved_pages -= req.reserved_pages
            self._free_rows.append(req.row)
        req.slots, req.row, req.last_node, req.reserved_pages, req.num_cached = [], None, None, 0, 0

    def _free_slots(self, slots: list[int]) -> None:
        """Free the pages of `slots`, which start on a page boundary."""
        self.allocator.free(self.allocator.pages_of(slots))

    def flush_cache(self) -> None:
        self.radix.flush()

    # -- integrity ---------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Req]) -> None:
        """Every page and row accounted for exactly once; the tree's locks match the requests."""
        live = [r for r in live if r.row is not None]
        held_rows = [r.row for r in live if r.row is not None]
        locked_nodes = [r.last_node for r in live if r.last_node is not None]
        if len(locked_nodes) != len(live):
            raise CacheIntegrityError("a request holds a table row but no radix node")
        p = self.page_size
        owners: dict[int, str] = {}

        def claim(pages: Iterable[int], owner: str) -> None:
            for page in pages:
                if page in owners:
                    raise CacheIntegrityError(
                        f"page {page} held by both {owners[page]} and {owner}"
                    )
                owners[page] = owner

        claim(
            (pg for pg in range(1, self.allocator.num_pages) if self.allocator.is_free(pg)),
            "the free list",
        )
        self.radix.check_integrity(locked_nodes)
        claim(self.radix.cached_pages(), "the radix cache")
        for req in live:
            claim((s // p for s in req.slots[req.num_cached :: p]), f"request {req.rid}")
            # backends read a request's KV page by page (FlashInfer): its tokens fill its pages
            if not _fills_pages_in_order(req.slots, p):
                raise CacheIntegrityError(
                    f"request {req.rid}'s tokens do not fill its pages in order"
                )
        if len(owners) != self.allocator.total_pages:
            lost = sorted(set(range(1, self.allocator.num_pages)) - owners.keys())
            raise CacheIntegrityError(
                f"{len(lost)} pages are neither free, cached nor held, e.g. {lost[:5]}"
            )
        if self.reserved_pages != sum(r.reserved_pages for r in live):
            raise CacheIntegrityError("reserved page count differs from the requests' reservations")
        rows = sorted(self._free_rows + held_rows)
        if rows != list(range(self.num_rows)):
            raise CacheIntegrityError("request table rows lost or held twice")


def _fills_pages_in_order(slots: list[int], page_size: int) -> bool:
    """Whether token i lies at offset i % page_size of a page that starts at a page boundary."""
    return all(
        slot % page_size == i % page_size and slot == slots[i - i % page_size] + i % page_size
        for i, slot in enumerate(slots)
    )
