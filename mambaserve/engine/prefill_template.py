"""Packed prefill-graph steps of lone prompts, kept as templates and patched per prompt.

A lone prompt's step (one prefill row, nothing decoding beside it) is the single-request TTFT
case: a new prompt from position 0, or the uncached suffix of a follow-up turn after a
prefix-cache hit (a restored state, a start P > 0). Its host time before the replay adds
straight onto the TTFT (docs/benchmarks.md, "Host time per step"). Its bucket bytes
(`pack_prefill_step` over `plan_metadata`) depend on the prompt through these parts only: the
token ids, the positions (P + 0 .. N-1), the slot mapping and the page-table row (from the
request's pages and the positions), the state slot, the restore's source and destination slots,
and, with the prefix cache on, the snapshots' destination slots (in their list and in the
per-chunk one). Everything else (conv windows, the SSD chunk grid, the snapshots' chunks and
conv windows, the padding rows, logit rows) is fixed by the key: the bucket, the token count N,
P modulo the chunk size (where the row's chunks are cut), whether the row continues a state and
restores one, the logit positions and the snapshot positions relative to P.

`SoloTemplates.plan` returns, for such a step whose key it has seen, a `HostMetadata` stub whose
`packed` field holds the bucket bytes: the template's own buffer with those parts written for
this prompt (the same bytes the full packing gives: tests/engine/test_prefill_template.py
compares them on random fresh prompts and follow-up suffixes). The buffer is rewritten by the
next step of the same key; the runner copies it into the step's upload at once, as it does the
bucket's scratch buffer. Any other step gets its full plan (`plan_metadata`). A lone prompt of a
key not seen yet has its bytes computed for it directly (engine/prefill_lone.py), in the bucket's
scratch buffer the first time (a key that never comes back costs no new memory) and into a
buffer kept as the key's template the second, up to MAX_TEMPLATE_BYTES of buffers (a lone
prompt's bucket is one without decode rows: `prefill_graph.decode_buckets` starts at 0). So a
prompt or suffix length seen before skips the planning and the packing: the
first-step host time of a fresh lone prompt drops by ~45 % on the project's 2-core CPU machine,
by 200–400 µs on an H100's host, a follow-up suffix's by 340–670 µs on the CPU machine; a prompt
of a new length pays ~120 µs more than a template hit there instead of ~400 (docs/benchmarks.md,
"Host time per step").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import HostMetadata

# host memory for templates per runner (one buffer per key): a bucket's bytes grow with its page
# table, ~60 KB for a 512-token bucket at max_model_len 4,096, ~0.5 MB for a 2,048-token one at
# 131,072; past the budget no new key is kept (its prompts are packed in the bucket's scratch
# buffer)
MAX_TEMPLATE_BYTES = 64 << 20
# lone prompts' keys seen once (a second prompt of the key makes it a template); forgotten all
# at once past this many
MAX_SEEN_KEYS = 4096
# the bucket's parts a lone prompt's data reaches (everything else is the key's)
PATCHED = ("input_ids", "positions", "slot_mapping", "page_table", "state_slots", "snap_dst",
           "chunk_snap_dst", "restore_src", "restore_dst")


@dataclass
class _Template:
    host: HostMetadata  # the stub handed on: the step's host ints, logits_idx, `packed`
    views: dict[str, np.ndarray]  # PATCHED parts of the packed buffer
    local: np.ndarray  # 0 .. N-1: the row's tokens
    snap_chunk: np.ndarray  # per snapshot: the chunk whose end it saves


def lone_prompt(batch: Batch) -> bool:
    """One prefill row and nothing decoding beside it: a fresh prompt or a follow-up turn's
    suffix on an otherwise idle engine."""
    return not batch.decodes and len(batch.prefills) == 1


def fresh_lone_prompt(batch: Batch) -> bool:
    """A lone prompt from position 0 with no initial state and no restore: a new request's first
    step on an otherwise idle engine."""
    if not lone_prompt(batch):
        return False
    r = batch.prefills[0]
    return not (r.start or r.has_initial_state or r.restore_from >= 0)


def solo_key(bucket: tuple, batch: Batch, chunk_size: int) -> tuple | None:
    """The template key of a lone prompt's step in `bucket`; None for any other step."""
    if not lone_prompt(batch):
        return None
    r = batch.prefills[0]
    return (bucket, r.num_tokens, r.start % chunk_size, bool(r.has_initial_state),
            r.restore_from >= 0, tuple(r.logits_positions),
            tuple(pos - r.start for pos, _ in r.snapshots))


class SoloTemplates:
    def __init__(self, page_size: int, scratch_page: int, chunk_size: int,
                 max_bytes: int = MAX_TEMPLATE_BYTES) -> None:
        self.page_size, self.scratch_page = page_size, scratch_page
        self.chunk_size, self.max_bytes, self.nbytes = chunk_size, max_bytes, 0
        self._by_key: dict[tuple, _Template] = {}
        self._seen: set[tuple] = set()  # keys of lone prompts packed once, not yet kept

    def __len__(self) -> int:
        """The templates held (one per lone-prompt key seen while the byte budget lasted)."""
        return len(self._by_key)

    def plan(self, bucket: tuple, batch: Batch, plan_full: Callable[[], HostMetadata],
             pack_lone: Callable[[bool], tuple[HostMetadata, dict[str, np.ndarray]]]
             ) -> HostMetadata:
        """The step's host side. A lone prompt of a known key: the key's stub, its bytes written
        for `batch`. A lone prompt of a new key: its stub, its bytes computed for it directly
        (`pack_lone`, engine/prefill_lone.py: `pack_lone(True)` into a buffer of their own, kept
        as the key's template, on the key's second prompt while the byte budget lasts,
        `pack_lone(False)` in the bucket's scratch buffer). Any other step: `plan_full()`
        (`plan_metadata`)."""
        key = solo_key(bucket, batch, self.chunk_size)
        if key is None:
            return plan_full()
        t = self._by_key.get(key)
        if t is None:
            # a key's first prompt: packed in the bucket's scratch buffer, not kept (a
            # template's buffer is new memory, whose first writes cost more than the packing
            # saves); its second: kept
            keep = self.nbytes < self.max_bytes and key in self._seen
            if not keep:
                if len(self._seen) >= MAX_SEEN_KEYS:
                    self._seen.clear()
                self._seen.add(key)
            host, views = pack_lone(keep)
            if not keep:
                return host
            t = self._remember(key, host, views, batch.prefills[0])
            self.nbytes += t.host.packed.nbytes
            return t.host  # (its bytes are this step's already)
        r, v = batch.prefills[0], t.views
        pages = np.array(r.pages, dtype=np.int64)
        positions = t.local + r.start
        page_of, offset = np.divmod(positions, self.page_size)
        v["input_ids"][: r.num_tokens] = r.token_array()
        v["positions"][: r.num_tokens] = positions
        v["slot_mapping"][: r.num_tokens] = pages[page_of] * self.page_size + offset
        v["page_table"][0, : len(pages)] = pages
        v["page_table"][0, len(pages):] = self.scratch_page
        v["state_slots"][0] = r.state_slot
        if r.restore_from >= 0:
            v["restore_src"][0], v["restore_dst"][0] = r.restore_from, r.state_slot
        for i, (_, dst) in enumerate(r.snapshots):
            v["snap_dst"][i] = dst
            v["chunk_snap_dst"][t.snap_chunk[i]] = dst
        return t.host

    def _remember(self, key: tuple, host: HostMetadata, bucket_views: dict[str, np.ndarray],
                  row: Row) -> _Template:
        # `host` (pack_lone's stub) is kept as it is: a replay reads none of its host ints that
        # depend on the prompt (the key fixes the logit rows and the restore count)
        # the chunk whose end each snapshot saves: the row's chunks are cut at absolute
        # multiples of the chunk size (metadata.py), its first one at its first token
        L, off = self.chunk_size, row.start % self.chunk_size
        snap_chunk = np.array([(off + pos - row.start - 1) // L for pos, _ in row.snapshots],
                              dtype=np.int64)
        t = self._by_key[key] = _Template(host, {n: bucket_views[n] for n in PATCHED},
                                          np.arange(row.num_tokens, dtype=np.int64), snap_chunk)
        return t
