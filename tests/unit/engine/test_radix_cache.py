from __future__ import annotations

import random

import pytest

from kubesgl.engine.kvcache.allocator import KVAllocationError, PageAllocator, pages_for
from kubesgl.engine.kvcache.radix_cache import CacheIntegrityError, RadixCache


def cache_with(page_size=1, pages=64):
    allocator = PageAllocator(pages, page_size)
    return RadixCache(allocator), allocator


def put(cache, allocator, tokens):
    """Insert `tokens` with freshly allocated slots, as a finished request would."""
    pages = allocator.alloc(len(tokens) // allocator.page_size)
    slots = allocator.slots_of(pages)
    already = cache.insert(tokens, slots)
    allocator.free(allocator.pages_of(slots[:already]))
    return slots


def test_match_insert_and_split():
    cache, allocator = cache_with()
    slots = put(cache, allocator, [1, 2, 3, 4, 5])
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.slots == slots[:3]
    # the match split the node at 3 tokens: [1,2,3] -> [4,5]
    assert len(cache.root.children) == 1
    upper = next(iter(cache.root.children.values()))
    assert upper.key == [1, 2, 3] and list(upper.children.values())[0].key == [4, 5]
    assert cache.insert([1, 2, 3, 9, 9], slots[:3] + allocator.slots_of(allocator.alloc(2))) == 3
    assert cache.evictable_size == 7
    cache.check_integrity([])


def test_page_aligned_matches_and_inserts():
    cache, allocator = cache_with(page_size=4)
    tokens = list(range(100, 112))  # three pages
    slots = put(cache, allocator, tokens)
    assert cache.match_prefix(tokens[:11]).slots == slots[:8]  # ends inside the third page
    assert cache.match_prefix(tokens[:3]).slots == []
    assert cache.match_prefix(tokens[:2] + [0] + tokens[3:]).slots == []  # a page differs inside
    assert cache.match_prefix(tokens[:6] + [0, 0, 0, 0]).slots == slots[:4]
    cache.check_integrity([])


def test_lock_protects_from_eviction_and_lru_order():
    cache, allocator = cache_with(pages=16)
    a = put(cache, allocator, [1, 2, 3])
    put(cache, allocator, [7, 8])
    put(cache, allocator, [9, 9, 9, 9])
    cache.match_prefix([7, 8])  # touch: [1,2,3] is now the least recently used
    locked = cache.match_prefix([9, 9, 9, 9]).node
    cache.lock(locked)
    assert (cache.evictable_size, cache.protected_size) == (5, 4)
    assert cache.evict(1) == 3  # the LRU leaf [1,2,3]
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert all(allocator.is_free(s) for s in a)
    assert cache.evict(100) == 2  # [7,8]; the locked node stays
    assert cache.match_prefix([9, 9, 9, 9]).node is locked
    cache.check_integrity([locked])
    with pytest.raises(CacheIntegrityError):
        cache.check_integrity([])  # the tree holds a lock nobody accounts for
    cache.unlock(locked)
    with pytest.raises(CacheIntegrityError, match="unlocked more often"):
        cache.unlock(locked)


def test_evicting_a_leaf_exposes_its_parent():
    cache, allocator = cache_with(pages=16)
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 5, 6])
    cache.flush()
    assert cache.evictable_size == 0 and not cache.root.children
    assert allocator.num_free == allocator.total_pages


def test_integrity_check_finds_corrupted_counts():
    cache, allocator = cache_with()
    put(cache, allocator, [1, 2, 3])
    cache.evictable_size += 1
    with pytest.raises(CacheIntegrityError, match="evictable"):
        cache.check_integrity([])


def test_random_workload_keeps_integrity():
    rng = random.Random(0)
    cache, allocator = cache_with(page_size=2, pages=400)
    held = []
    for _ in range(300):
        prefix = [rng.randrange(3) for _ in range(rng.choice([2, 4, 6]))]
        tokens = prefix + [rng.randrange(50) for _ in range(2 * rng.randrange(1, 6))]
        if allocator.num_free < len(tokens):
            cache.evict(len(tokens))
        put(cache, allocator, tokens)
        node = cache.match_prefix(tokens).node
        cache.lock(node)
        held.append(node)
        if len(held) > 5:
            cache.unlock(held.pop(rng.randrange(len(held))))
        cache.check_integrity(held)
        cached = len(cache.cached_pages())
        assert cached + allocator.num_free == allocator.total_pages


@pytest.mark.parametrize(
    ("tokens", "page_size", "pages"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (7, 1, 7)]
)
def test_pages_for_rounds_a_part_full_page_up(tokens, page_size, pages):
    assert pages_for(tokens, page_size) == pages


def test_pages_of_slots_and_slots_of_pages_invert_each_other():
    allocator = PageAllocator(16, 4)
    pages = allocator.alloc(3)
    slots = allocator.slots_of(pages)
    assert allocator.pages_of(slots) == pages
    assert allocator.pages_of(slots[:9]) == pages  # a last page part full


def test_allocator_rejects_double_free_and_overdraw():
    allocator = PageAllocator(4, 1)
    pages = allocator.alloc(3)
    assert 0 not in pages  # page 0 is the padding page
    with pytest.raises(KVAllocationError):
        allocator.alloc(1)
    allocator.free(pages[:1])
    with pytest.raises(KVAllocationError, match="freed twice"):
        allocator.free(pages[:1])
    with pytest.raises(KVAllocationError, match="not in the pool"):
        allocator.free([0])


def test_no_prefix_cache_keeps_nothing_and_leaves_the_kv_with_its_owner():
    """--disable-radix-cache: the KV manager's code is the same, the tree refuses every insert."""
    from kubesgl.engine.kvcache.radix_cache import NoPrefixCache
    from kubesgl.engine.sampling_params import SamplingParams
    from kubesgl.engine.scheduler.kv_manager import KVManager
    from kubesgl.engine.scheduler.request import Req

    allocator = PageAllocator(16, 4)
    kv = KVManager(allocator, NoPrefixCache(allocator), num_rows=2)
    first, second = (Req(rid=r, prompt_ids=list(range(10)), params=SamplingParams()) for r in "ab")
    for req in (first, second):
        assert kv.try_admit(req, 12)
        kv.grow(req, 10)
        req.num_computed = 10
        kv.cache_prefix(req)
        assert req.num_cached == 0 and req.num_prefix_hit == 0 and req.last_node is kv.radix.root
    kv.check_integrity([first, second])
    assert kv.radix.cached_pages() == [] and kv.radix.peek_prefix(list(range(10))) == (
        0,
        kv.radix.root,
    )
    for req in (first, second):
        kv.release(req)
    kv.check_integrity([])
    assert allocator.num_free == allocator.total_pages


def test_integrity_check_finds_a_request_whose_tokens_do_not_fill_its_pages_in_order():
    """FlashInfer reads a request's KV page by page: token i must be at offset i % page_size."""
    from kubesgl.engine.kvcache.radix_cache import NoPrefixCache
    from kubesgl.engine.sampling_params import SamplingParams
    from kubesgl.engine.scheduler.kv_manager import KVManager
    from kubesgl.engine.scheduler.request import Req

    allocator = PageAllocator(16, 4)
    kv = KVManager(allocator, NoPrefixCache(allocator), num_rows=1)
    req = Req(rid="a", prompt_ids=list(range(10)), params=SamplingParams())
    assert kv.try_admit(req, 12)
    kv.grow(req, 10)
    kv.check_integrity([req])
    req.slots[4], req.slots[5] = req.slots[5], req.slots[4]  # same pages, out of order
    with pytest.raises(CacheIntegrityError, match="do not fill its pages in order"):
        kv.check_integrity([req])
