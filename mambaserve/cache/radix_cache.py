"""Prefix cache for hybrid models: a radix tree over token ids whose edges are fixed blocks of
`interval` tokens (the snapshot interval), with Mamba state snapshots at block ends.

An SSM state exists only for the exact prefix it summarizes, so a hit can only start at a
position where a snapshot was taken; blocks are therefore `interval` tokens long (a multiple of
the SSD chunk size and of the KV page size), and a match is the deepest node on the prompt's path
that owns a snapshot slot. Every node carries the KV pages of its block.

Cache salt (vLLM's `cache_salt`): a request that carries a salt puts it in front of its first
block's edge key, (salt, *block); unsalted first blocks and every deeper block are keyed by their
tokens alone. A salt is a string and a token id an int, so a salted key never equals an
unsalted one, and two salts never share a first block: the tree splits at the root into one
subtree per salt (plus the unsalted one), and a path (hence every hit, page and snapshot under
it) is reachable only with the salt it was inserted with. Eviction, locks and metrics are blind
to the salt: one LRU order over all subtrees.

Invariants (checked by `check_integrity`)
| what                 | rule                                                                 |
|----------------------|----------------------------------------------------------------------|
| node.key             | one block of `interval` token ids; at depth 1 it may start with the  |
|                      | salt (a str), nowhere else                                           |
| node.pages           | exactly interval / page_size pages; the tree holds one reference     |
| node.slot            | -1 or a state slot owned by the tree alone, holding the state after  |
|                      | the node's whole path                                                |
| node.lock            | number of running requests whose hit path contains the node; locked  |
|                      | nodes are never evicted                                              |
| eviction             | LRU: an unlocked leaf is removed (slot freed, pages released); an    |
|                      | unlocked inner node can lose its slot; paths stay contiguous         |

Eviction order: the least recently used candidate first, by (last_access, deeper first). A match
or insert touches a whole path in one tick, so an ancestor is never older than its descendants
and ties fall to the deepest node: leaves go before the blocks they extend. The candidates sit in
a heap of (last_access, -depth) entries pushed whenever a node is touched, unlocked or left
without children; an entry that no longer describes its node (touched since, evicted, locked,
not a candidate) is dropped when popped, so an eviction costs O(log nodes) per victim instead
of a walk over the tree (8,000 nodes: ~16 ms per victim on a 2-core CPU, paid by the engine's
step whenever a full state pool must hand out a snapshot slot; scripts/prefix_cache_evict_bench.py).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool


@dataclass(eq=False)
class Node:
    key: tuple  # the block's token ids; (salt, *token ids) for a salted first block
    parent: Node | None
    depth: int  # blocks from the root
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    lock: int = 0
    last_access: int = 0
    children: dict[tuple, Node] = field(default_factory=dict)
    evicted: bool = False  # removed from the tree (its heap entries are dead)


@dataclass
class Match:
    path: list[Node]  # nodes matching the prompt's leading blocks, root excluded
    hit_depth: int  # blocks up to the deepest node with a snapshot (0 = miss)

class PrefixCache:
    def __init__(self, interval: int, state_pool: StatePool, kv_pool: KVPool) -> None:
        if interval % kv_pool.page_size:
            raise ValueError(f"mamba_snapshot_interval={interval} must be a multiple of the KV "
                             f"page size {kv_pool.page_size}")
        self.interval, self.state_pool, self.kv_pool = interval, state_pool, kv_pool
        self.pages_per_block = interval // kv_pool.page_size
        self.root = Node((), None, 0)
        self._clock = 0
        # eviction candidates: (last_access, -depth, push order, node); stale entries included
        self._heap: list[tuple[int, int, int, Node]] = []
        self._pushes = itertools.count()
        self._num_nodes = self._num_snapshots = 0  # kept as they change: stats() walks nothing
        self.metrics = {"queries": 0, "hits": 0, "query_tokens": 0, "hit_tokens": 0,
                        "evicted_nodes": 0, "evicted_snapshots": 0, "inserted_snapshots": 0}

    # ---- lookup ----------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: Node, now: int) -> None:
        node.last_access = now
        self._push(node)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, -node.depth, next(self._pushes), node))
        if len(self._heap) > 4 * self._num_nodes + 64:  # mostly stale entries: start afresh
            self._heap = [(n.last_access, -n.depth, next(self._pushes), n) for n in self.nodes()]
            heapq.heapify(self._heap)

    def _key(self, tokens: list[int], d: int, salt: str | None) -> tuple:
        """The edge key of block `d` of `tokens`: its token ids, behind the salt at d = 0."""
        block = tuple(tokens[d * self.interval:(d + 1) * self.interval])
        return block if d or salt is None else (salt, *block)

    def match(self, tokens: list[int], max_len: int, salt: str | None = None) -> Match:
        """Longest block path of `tokens[:max_len]` in the tree (in `salt`'s subtree); the hit
        is its deepest node with a snapshot."""
        node, path, hit = self.root, [], 0
        now = self._tick()
        for d in range(max_len // self.interval):
            child = node.children.get(self._key(tokens, d, salt))
            if child is None:
                break
            self._touch(child, now)
            path.append(child)
            if child.slot >= 0:
                hit = d + 1
            node = child
        return Match(path, hit)

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        m = self.metrics
        m["queries"] += 1
        m["query_tokens"] += num_tokens
        m["hits"] += hit_tokens > 0
        m["hit_tokens"] += hit_tokens

    def lock(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.lock += 1

    def unlock(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.lock <= 0:
                raise RuntimeError("unlocking a node that is not locked")
            n.lock -= 1
            if n.lock == 0:  # its entries were dropped while it was locked
                self._push(n)

    def path_pages(self, nodes: list[Node]) -> list[int]:
        return [p for n in nodes for p in n.pages]

    # ---- insertion -------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], slot: int,
               salt: str | None = None) -> Node:
        """Add the blocks of `tokens` (a whole number of blocks) with the request's KV `pages`
        (covering at least those tokens) under `salt`'s subtree; hand `slot` (the state after
        all of `tokens`, or -1) to the last node. A slot the tree already has a snapshot for is
        freed. Returns the last node."""
        n_blocks = len(tokens) // self.interval
        if n_blocks * self.interval != len(tokens) or n_blocks == 0:
            raise ValueError("insert takes a positive whole number of blocks")
        node, now = self.root, self._tick()
        for d in range(n_blocks):
            key = self._key(tokens, d, salt)
            child = node.children.get(key)
            if child is None:
                block_pages = pages[d * self.pages_per_block:(d + 1) * self.pages_per_block]
                self.kv_pool.retain(block_pages)
                child = Node(key, node, d + 1, pages=list(block_pages))
                node.children[key] = child
                self._num_nodes += 1
            self._touch(child, now)
            node = child
        if slot >= 0:
            if node.slot < 0:
                node.slot = slot
                self._num_snapshots += 1
                self.metrics["inserted_snapshots"] += 1
            else:
                self.state_pool.free(slot)
        return node

    # ---- eviction --------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, slots: int = 0, pages: int = 0) -> bool:
        """Free cached entries, least recently used first (module docstring), until `slots`
        state slots and `pages` KV pages are free. Returns whether that was reached."""
        set_aside: list[tuple[int, int, int, Node]] = []  # slot holders skipped for pages
        ok = True
        while self.state_pool.num_free < slots or self.kv_pool.num_free < pages:
            need_pages = self.kv_pool.num_free < pages
            if not need_pages and set_aside:  # inner slot holders are candidates again
                for entry in set_aside:
                    heapq.heappush(self._heap, entry)
                set_aside = []
            victim = self._pop_victim(need_pages, set_aside)
            if victim is None:
                ok = False
                break
            if victim.slot >= 0:
                self.state_pool.free(victim.slot)
                victim.slot = -1
                self._num_snapshots -= 1
                self.metrics["evicted_snapshots"] += 1
            if not victim.children:
                self.kv_pool.release(victim.pages)
                parent = victim.parent
                del parent.children[victim.key]
                victim.evicted = True
                self._num_nodes -= 1
                self.metrics["evicted_nodes"] += 1
                if parent is not self.root and not parent.children:
                    self._push(parent)  # a leaf now
        for entry in set_aside:
            heapq.heappush(self._heap, entry)
        return ok

    def _pop_victim(self, need_pages: bool, set_aside: list) -> Node | None:
        """The least recently used candidate: an unlocked leaf, or (slots only) an unlocked
        inner node with a slot. Entries of nodes that are no candidate now are dropped (a node
        is pushed again when it is touched, unlocked or loses its last child); slot holders
        skipped because pages are needed go to `set_aside`."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            last_access, _, _, n = entry
            if n.evicted or n.lock or last_access != n.last_access:
                continue
            if n.children:
                if n.slot < 0:
                    continue
                if need_pages:
                    set_aside.append(entry)
                    continue
            return n
        return None

    # ---- introspection ---------------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        return self._num_snapshots

    def stats(self) -> dict:
        m = dict(self.metrics)
        m["token_hit_rate"] = m["hit_tokens"] / m["query_tokens"] if m["query_tokens"] else 0.0
        m["request_hit_rate"] = m["hits"] / m["queries"] if m["queries"] else 0.0
        m["snapshots"] = self.num_snapshots
        m["snapshot_bytes"] = m["snapshots"] * self.state_pool.bytes_per_slot_actual
        m["nodes"] = self._num_nodes
        return m

    def check_integrity(self, request_pages: list[list[int]], request_slots: list[int],
                        request_paths: list[list[Node]]) -> None:
        """Raise AssertionError unless every page reference, slot and lock is accounted for."""
        nodes = self.nodes()
        assert self._num_nodes == len(nodes), "node count out of step with the tree"
        assert self._num_snapshots == sum(n.slot >= 0 for n in nodes), "snapshot count off"
        refs = [0] * self.kv_pool.num_pages
        for n in nodes:
            assert len(n.pages) == self.pages_per_block, "node without a whole block of pages"
            salted = isinstance(n.key[0], str)
            assert len(n.key) == self.interval + salted and (n.depth == 1 or not salted), \
                "a key is one block of tokens, behind a salt only at depth 1"
            assert n.parent is not None and n.parent.children.get(n.key) is n, "broken tree link"
            for p in n.pages:
                refs[p] += 1
        for pages in request_pages:
            for p in pages:
                refs[p] += 1
        assert refs == self.kv_pool.ref_count, "page reference counts do not add up"
        free_pages = set(self.kv_pool._free)
        assert len(free_pages) == len(self.kv_pool._free), "page freed twice"
        assert free_pages == {p for p, c in enumerate(refs) if c == 0}, "leaked or lost pages"
        used = [n.slot for n in nodes if n.slot >= 0] + list(request_slots)
        assert len(used) == len(set(used)), "a state slot has two owners"
        free_slots = self.state_pool._free
        assert len(free_slots) == len(set(free_slots)), "slot freed twice"
        assert set(used).isdisjoint(free_slots), "a slot in use is also free"
        assert len(used) + len(free_slots) == self.state_pool.num_slots, "leaked state slots"
        locks: dict[int, int] = {}
        for path in request_paths:
            for n in path:
                locks[id(n)] = locks.get(id(n), 0) + 1
        for n in nodes:
            assert n.lock == locks.get(id(n), 0), "lock count does not match running requests"
