"""The block radix tree on its own: match, insert, LRU eviction, locks, integrity checks."""

import pytest
import torch

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.radix_cache import PrefixCache
from mambaserve.cache.state_pool import StatePool
from mambaserve.config import ModelConfig


@pytest.fixture()
def cache(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    sp = StatePool(cfg, 6, torch.float32, torch.float32, "cpu")
    kv = KVPool(cfg, 20, 4, torch.float32, "cpu")
    return PrefixCache(8, sp, kv)


def seq(*blocks):
    return [t for b in blocks for t in [b] * 8]


def owned(cache, n):
    """A 'request' holding n pages and one slot, as the scheduler would give it."""
    return cache.kv_pool.allocate(n), cache.state_pool.allocate()


def test_match_insert_and_hit_depth(cache):
    pages, slot = owned(cache, 6)
    tokens = seq(1, 2, 3)
    cache.insert(tokens, pages, slot)  # snapshot after 3 blocks
    cache.kv_pool.release(pages)  # the request ends; the tree keeps its references
    cache.check_integrity([], [], [])
    m = cache.match(seq(1, 2, 3, 4), max_len=32)
    assert len(m.path) == 3 and m.hit_depth == 3 and m.path[m.hit_depth - 1].slot == slot
    assert cache.match(seq(1, 2, 3), max_len=23).hit_depth == 0  # must leave a token to run
    m = cache.match(seq(1, 2, 9), max_len=32)
    assert len(m.path) == 2 and m.hit_depth == 0
    assert cache.path_pages(m.path) == pages[:4]


def test_second_snapshot_for_same_node_is_freed(cache):
    pages, slot = owned(cache, 4)
    cache.insert(seq(1, 2), pages, slot)
    pages2, slot2 = owned(cache, 4)
    free_before = cache.state_pool.num_free
    node = cache.insert(seq(1, 2), pages2, slot2)
    assert node.slot == slot and cache.state_pool.num_free == free_before + 1
    cache.kv_pool.release(pages)
    cache.kv_pool.release(pages2)
    cache.check_integrity([], [], [])
    assert cache.kv_pool.num_free == 20 - 4  # the duplicate request pages went back


def test_lru_eviction_and_locks(cache):
    paths = []
    for b in (1, 2, 3):
        pages, slot = owned(cache, 2)
        cache.insert(seq(b), pages, slot)
        cache.kv_pool.release(pages)
        paths.append(cache.match(seq(b, 0), 16).path)
    cache.match(seq(1, 0), 16)  # touch block 1: block 2 is now least recently used
    cache.lock(paths[1])
    assert cache.evict(slots=cache.state_pool.num_free + 1)
    assert sorted(n.key[0] for n in cache.nodes()) == [1, 2]
    assert cache.match(seq(3, 0), 16).hit_depth == 0  # 3 went (2 is locked, 1 was touched)
    cache.check_integrity([], [], [paths[1]])
    assert not cache.evict(slots=cache.state_pool.num_slots)  # locked node stays
    cache.unlock(paths[1])
    assert cache.evict(slots=cache.state_pool.num_slots, pages=20)
    assert cache.nodes() == [] and cache.kv_pool.num_free == 20
    assert cache.metrics["evicted_nodes"] == 3


def test_inner_node_gives_up_only_its_slot(cache):
    pages, slot = owned(cache, 4)
    cache.insert(seq(1), pages, slot)
    slot2 = cache.state_pool.allocate()
    cache.insert(seq(1, 2), pages, slot2)
    cache.kv_pool.release(pages)
    leaf = cache.match(seq(1, 2, 0), 24).path[1]
    cache.lock([leaf])  # the leaf (evicted first otherwise: deeper) is in use
    assert cache.evict(slots=cache.state_pool.num_free + 1)
    inner = cache.match(seq(1, 2, 0), 24).path[0]
    assert inner.slot == -1 and inner.children and len(cache.nodes()) == 2
    cache.check_integrity([], [], [[leaf]])


def test_ties_evict_the_deeper_node_first(cache):
    """One insert touches its whole path in one tick: the leaf goes before the inner node."""
    pages, slot = owned(cache, 4)
    cache.insert(seq(1), pages, slot)
    cache.insert(seq(1, 2), pages, cache.state_pool.allocate())
    cache.kv_pool.release(pages)
    assert cache.evict(slots=cache.state_pool.num_free + 1)
    assert [n.key[0] for n in cache.nodes()] == [1] and cache.nodes()[0].slot == slot


def _reference_victim(cache, need_pages):
    """The LRU rule by a walk over the whole tree (what the heap must agree with)."""
    cands = [n for n in cache.nodes() if n.lock == 0 and (
        not n.children or (n.slot >= 0 and not need_pages))]
    return min(cands, key=lambda n: (n.last_access, -n.depth), default=None)


@pytest.mark.parametrize("salts", [(None,), (None, "a", "b")])
def test_eviction_order_matches_a_walk_over_the_tree(tiny_ckpt, salts):
    """Random inserts, matches, locks and evictions for slots or pages: every victim the heap
    picks is the one the walk picks, and the tree stays consistent; with salts, over several
    salted subtrees at once."""
    import random

    cfg = ModelConfig.from_hf(tiny_ckpt)
    sp = StatePool(cfg, 40, torch.float32, torch.float32, "cpu")
    kv = KVPool(cfg, 400, 4, torch.float32, "cpu")
    cache = PrefixCache(8, sp, kv)
    rng = random.Random(0)
    locked: list[list] = []
    victims = 0
    orig_pop = cache._pop_victim

    def checked_pop(need_pages, set_aside):
        nonlocal victims
        want = _reference_victim(cache, need_pages)
        got = orig_pop(need_pages, set_aside)
        assert got is want
        victims += got is not None
        return got

    cache._pop_victim = checked_pop
    for _ in range(600):
        op = rng.random()
        blocks = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
        salt = rng.choice(salts) if len(salts) > 1 else None
        if op < 0.4 and kv.num_free >= 2 * len(blocks) and sp.num_free:
            pages = kv.allocate(2 * len(blocks))
            cache.insert(seq(*blocks), pages, sp.allocate() if rng.random() < 0.7 else -1,
                         salt)
            kv.release(pages)
        elif op < 0.6:
            path = cache.match(seq(*blocks, 9), 8 * len(blocks) + 1, salt).path
            if path and rng.random() < 0.3:
                cache.lock(path)
                locked.append(path)
        elif op < 0.7 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.85:
            cache.evict(slots=sp.num_free + rng.randrange(1, 4))
        else:
            cache.evict(pages=kv.num_free + 2 * rng.randrange(1, 4))
        cache.check_integrity([], [], locked)
        assert len(cache._heap) <= 4 * len(cache.nodes()) + 65
    assert victims > 100
    if len(salts) > 1:  # every salt (and no salt) had its own subtree at the root
        assert {n.key[0] if isinstance(n.key[0], str) else None
                for n in cache.nodes() if n.depth == 1} <= set(salts)


def test_salted_first_blocks_partition_the_tree(cache):
    """Same tokens, different salts: separate subtrees, each hit only with its own salt."""
    slots = {}
    for salt in (None, "a"):
        pages, slot = owned(cache, 4)
        cache.insert(seq(1, 2), pages, slot, salt)
        cache.kv_pool.release(pages)
        slots[salt] = slot
    cache.check_integrity([], [], [])
    assert len(cache.nodes()) == 4 and cache.num_snapshots == 2
    assert sorted(map(repr, cache.root.children)) == sorted(
        [repr(tuple(seq(1))), repr(("a", *seq(1)))])
    deeper = [n for n in cache.nodes() if n.depth == 2]
    assert [n.key for n in deeper] == [tuple(seq(2))] * 2  # the salt is in the first key only
    for salt in (None, "a"):
        m = cache.match(seq(1, 2, 3), 24, salt)
        assert m.hit_depth == 2 and m.path[1].slot == slots[salt]
        assert m.path[0].parent is cache.root
    for salt in ("b", "A", "a "):  # any other salt: nothing shared, not even a block
        assert cache.match(seq(1, 2, 3), 24, salt).path == []
    # a salted insert extends only its own subtree
    pages, slot = owned(cache, 6)
    cache.insert(seq(1, 2, 3), pages, slot, "a")
    cache.kv_pool.release(pages)
    assert cache.match(seq(1, 2, 3, 4), 32, "a").hit_depth == 3
    assert cache.match(seq(1, 2, 3, 4), 32).hit_depth == 2
    cache.check_integrity([], [], [])


def test_salted_nodes_are_evicted_and_locked_like_any(cache):
    """One LRU order over every subtree; a lock holds a salted path; evicting all of it leaves
    the pools whole."""
    for salt in ("a", None, "b"):
        pages, slot = owned(cache, 2)
        cache.insert(seq(7), pages, slot, salt)
        cache.kv_pool.release(pages)
    cache.match(seq(7, 0), 16, "a")  # touch "a": the unsalted entry is now the oldest
    assert cache.evict(slots=cache.state_pool.num_free + 1)
    assert cache.match(seq(7, 0), 16).path == []
    assert cache.match(seq(7, 0), 16, "a").hit_depth == 1
    locked = cache.match(seq(7, 0), 16, "b").path
    cache.lock(locked)
    assert not cache.evict(slots=cache.state_pool.num_slots)  # "b" is locked: stays
    cache.check_integrity([], [], [locked])
    assert [n.key[0] for n in cache.nodes()] == ["b"]
    cache.unlock(locked)
    assert cache.evict(slots=cache.state_pool.num_slots, pages=20)
    assert cache.nodes() == [] and cache.kv_pool.num_free == 20
    assert cache.stats()["nodes"] == 0 and cache.metrics["evicted_nodes"] == 3
    cache.check_integrity([], [], [])


def test_integrity_catches_leaks(cache):
    pages, slot = owned(cache, 2)
    cache.insert(seq(1), pages, slot)
    with pytest.raises(AssertionError, match="page reference counts"):
        cache.check_integrity([], [], [])  # the request's page references are unaccounted
    cache.check_integrity([pages], [], [])
    cache.kv_pool.release(pages)
    leaked = cache.state_pool.allocate()
    with pytest.raises(AssertionError, match="leaked state slots"):
        cache.check_integrity([], [], [])
    cache.check_integrity([], [leaked], [])
    with pytest.raises(AssertionError, match="two owners"):
        cache.check_integrity([], [leaked, slot], [])


def test_integrity_catches_a_salt_below_the_first_block(cache):
    pages, slot = owned(cache, 4)
    node = cache.insert(seq(1, 2), pages, slot, "a")
    cache.kv_pool.release(pages)
    cache.check_integrity([], [], [])
    del node.parent.children[node.key]
    node.key = ("a", *node.key)  # a salt on a depth-2 key (with the link kept whole)
    node.parent.children[node.key] = node
    with pytest.raises(AssertionError, match="behind a salt only at depth 1"):
        cache.check_integrity([], [], [])


def test_interval_must_hold_whole_pages(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    sp = StatePool(cfg, 2, torch.float32, torch.float32, "cpu")
    kv = KVPool(cfg, 4, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of the KV page size"):
        PrefixCache(8, sp, kv)
