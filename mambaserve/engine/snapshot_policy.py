"""Which states the prefix cache snapshots, and when a request reuses one.

Policy (every position is a multiple of the snapshot interval I):
- Hit: on admission a request restores the deepest snapshot on its prompt's path in the tree,
  at most at prompt_len - 1 (one token must run to produce logits), and shares the KV pages of
  every block up to it. Its matched path is locked until it finishes.
- Divergence snapshot: if the prompt matches tree blocks deeper than its hit (another request
  went there, but no snapshot exists at the end of the shared part), the request snapshots the
  end of the deepest matched block while prefilling and hands it to that node at once. This is
  how a shared system prompt that ends mid-way gets a snapshot the next request hits.
- Prompt snapshot: the state at the prompt's last block end that a repeat of the prompt could
  hit (the last multiple of I <= prompt_len - 1), also handed to the tree as soon as it is
  written, so identical prompts and few-shot prefixes hit from the second request on.
- Latest snapshot: each request keeps one private slot with its state at the last multiple of I
  it has passed (in prefill or decode), overwritten as it goes. When the request ends, its blocks
  up to that position enter the tree with the slot (no copy). This is what a follow-up turn
  (old prompt + output + new text) hits: everything up to the last multiple of I <= L - 1 of the
  old conversation of L tokens (the last sampled token is never fed, so its state never exists).
Snapshots are taken only when a slot is free or can be freed by evicting cached entries; they
are an optimization and never make a request wait.

Under overlap scheduling a row's snapshots are planned before the previous step's results are
applied, so each is accounted to the row that writes it (`after_forward(req, row)`), and a request
that ends while a step holding one of its rows is in flight is released after that step
(engine/scheduler.py). A preempted request is released like a finished one: its latest snapshot
and blocks enter the tree, and its recompute (prompt + generated tokens) matches them.

Cache salt: every match and insert of a request passes its `cache_salt` (None: unsalted), so it
hits, extends and hands snapshots only to the tree's subtree of that salt (cache/radix_cache.py);
the n > 1 completions of one request and a preempted request's recompute carry the same salt.
"""

from __future__ import annotations

from mambaserve.cache.radix_cache import Node, PrefixCache
from mambaserve.engine.batch import Row
from mambaserve.engine.request import Request


class SnapshotPolicy:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.interval = cache.interval
        self.state_pool, self.kv_pool = cache.state_pool, cache.kv_pool

    # ---- admission -------------------------------------------------------------------------
    def match(self, req: Request) -> tuple[list[Node], int]:
        """The matched path (to lock) and the hit length in tokens."""
        n = req.prefill_len
        m = self.cache.match(req.all_token_ids[:n], n - 1, req.cache_salt)
        if req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.prompt_len:
            # every prompt token's logprob is asked for: compute them all (no hit), but still
            # lock the path and leave snapshots for later requests
            return m.path, 0
        return m.path, m.hit_depth * self.interval

    def admit(self, req: Request, path: list[Node], hit_len: int, new_pages: list[int]) -> int:
        """Called once the live slot and the new pages are allocated. Returns the cached
        snapshot slot the request's first forward restores into its live slot (-1: none)."""
        hit_nodes = path[: hit_len // self.interval]
        shared = self.cache.path_pages(hit_nodes)
        self.kv_pool.retain(shared)
        req.pages = shared + new_pages
        req.cache_path = path
        self.cache.lock(path)
        req.num_computed = hit_len
        if not req.num_preemptions:  # what the user sees: the first admission's reuse
            req.num_cached_tokens = hit_len
        targets = set()
        deepest = path[-1] if path else None
        if deepest is not None and deepest.depth * self.interval > hit_len and deepest.slot < 0:
            targets.add(deepest.depth * self.interval)  # divergence point
        prompt_pos = (req.prefill_len - 1) // self.interval * self.interval
        if prompt_pos > hit_len:
            targets.add(prompt_pos)
        req.tree_snapshots = {p: -1 for p in sorted(targets)}
        self.cache.record_query(req.prefill_len, hit_len)
        return hit_nodes[-1].slot if hit_nodes else -1

    def pages_shared(self, hit_len: int) -> int:
        """KV pages a hit of `hit_len` tokens shares with the tree instead of allocating."""
        return (hit_len // self.interval) * self.cache.pages_per_block

    def make_room(self, path: list[Node], slots: int, pages: int) -> bool:
        """Evict cached entries (never the request's own matched path) until it fits."""
        self.cache.lock(path)
        try:
            return self.cache.evict(slots=slots, pages=pages)
        finally:
            self.cache.unlock(path)

    # ---- per forward -----------------------------------------------------------------------
    def _slot(self) -> int:
        if self.state_pool.num_free == 0:
            self.cache.evict(slots=1)
        return self.state_pool.allocate() if self.state_pool.num_free else -1

    def snapshots_for(self, req: Request, start: int, num_tokens: int,
                      is_decode: bool) -> list[tuple[int, int]]:
        """(position, destination slot) pairs to save while this row runs."""
        I = self.interval
        end = start + num_tokens  # the row's state after the forward is at position `end`
        boundaries = [p for p in range((start // I + 1) * I, end + 1, I)]
        if not boundaries:
            return []
        out: list[tuple[int, int]] = []
        if not is_decode:
            for pos in req.tree_snapshots:
                if pos in boundaries:
                    slot = self._slot()
                    if slot >= 0:
                        out.append((pos, slot))
                        req.tree_snapshots[pos] = slot
        last = boundaries[-1]
        if last not in req.tree_snapshots or is_decode:
            if req.pending_slot < 0:
                req.pending_slot = self._slot()
            if req.pending_slot >= 0:
                out.append((last, req.pending_slot))
        return out

    def after_forward(self, req: Request, row: Row) -> None:
        """The forward of `row` (one of `req`'s rows) has run: its tree snapshots enter the tree,
        and the request's latest snapshot is at the position the row wrote."""
        for pos, slot in row.snapshots:
            if slot >= 0 and req.tree_snapshots.get(pos) == slot:
                self.cache.insert(req.all_token_ids[:pos], req.pages, slot, req.cache_salt)
                del req.tree_snapshots[pos]
            elif slot >= 0 and slot == req.pending_slot:
                req.pending_pos = pos

    # ---- end -------------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """The request ended: its latest snapshot and blocks enter the tree; unlock its path."""
        if req.pending_slot >= 0:
            # (an aborted request's last row may have fed a token that was never read back)
            if 0 < req.pending_pos <= len(req.all_token_ids):
                self.cache.insert(req.all_token_ids[: req.pending_pos], req.pages,
                                  req.pending_slot, req.cache_salt)
            else:
                self.state_pool.free(req.pending_slot)
            req.pending_slot, req.pending_pos = -1, 0
        for slot in req.tree_snapshots.values():  # reserved but the forward never ran
            if slot >= 0:
                self.state_pool.free(slot)
        req.tree_snapshots = {}
        if req.cache_path:
            self.cache.unlock(req.cache_path)
            req.cache_path = []
