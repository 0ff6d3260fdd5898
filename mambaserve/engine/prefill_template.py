"""Packed prefill-graph steps of fresh lone prompts, kept as templates and patched per prompt.

A lone prompt's first step (one prefill row from position 0, no initial state, no restore,
nothing decoding beside it) is the single-request TTFT case, and its host time before the
replay adds straight onto the TTFT (docs/benchmarks.md, "Host time per step"). Its bucket bytes
(`pack_prefill_step` over `plan_metadata`) depend on the prompt only through five parts: the
token ids, the slot mapping and the page-table row (from the request's pages), the state slot
and, with the prefix cache on, the snapshots' destination slots (in their list and in the
per-chunk one). Everything else (positions,
conv windows, the SSD chunk grid, the snapshots' chunks and conv windows, the padding rows,
logit rows) is fixed by the bucket, the token count, the number of pages, the snapshot
positions and the logit positions.

`SoloTemplates.plan` returns, for such a step whose key it has seen, a `HostMetadata` stub whose
`packed` field holds the bucket bytes: the template's own buffer with those five parts written
for this prompt (the same bytes the full packing gives: tests/engine/test_prefill_template.py
compares them on random prompts). The buffer is rewritten by the next step of the same key; the
runner copies it into the step's upload at once, as it does the bucket's scratch buffer. Any
other step gets its full plan (`plan_metadata`); a fresh lone prompt of a key not seen yet is
planned and packed in full once and kept as its key's template, up to MAX_TEMPLATES keys. So a
prompt length seen before skips the planning and the packing: the first-step host time of a lone
prompt drops by ~45 % on the project's 2-core CPU machine, by 200–400 µs on an H100's host
(docs/benchmarks.md, "Host time per step").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from mambaserve.engine.batch import Batch
from mambaserve.metadata import HostMetadata

# templates kept per runner (one per key): a 512-token bucket's bytes are ~60 KB, so at most
# ~30 MB of host memory
MAX_TEMPLATES = 512
# the bucket's parts a fresh lone prompt's data reaches (everything else is the key's)
PATCHED = ("input_ids", "slot_mapping", "page_table", "state_slots", "snap_dst",
           "chunk_snap_dst")


@dataclass
class _Template:
    host: HostMetadata  # the stub handed on: the step's host ints, logits_idx, `packed`
    views: dict[str, np.ndarray]  # PATCHED parts of the packed buffer
    page_of: np.ndarray  # per token: its page's index in the row's page list
    offset: np.ndarray  # per token: its slot inside that page
    snap_chunk: np.ndarray  # per snapshot: the chunk whose end it saves


def fresh_lone_prompt(batch: Batch) -> bool:
    """One prefill row from position 0 with no initial state and no restore, nothing decoding
    beside it: a new request's first step on an otherwise idle engine."""
    if batch.decodes or len(batch.prefills) != 1:
        return False
    r = batch.prefills[0]
    return not (r.start or r.has_initial_state or r.restore_from >= 0)


def solo_key(bucket: tuple, batch: Batch) -> tuple | None:
    """The template key of a fresh lone prompt's step in `bucket`; None for any other step."""
    if not fresh_lone_prompt(batch):
        return None
    r = batch.prefills[0]
    return (bucket, r.num_tokens, len(r.pages), tuple(r.logits_positions),
            tuple(pos for pos, _ in r.snapshots))


class SoloTemplates:
    def __init__(self, page_size: int, max_templates: int = MAX_TEMPLATES) -> None:
        self.page_size, self.max_templates = page_size, max_templates
        self._by_key: dict[tuple, _Template] = {}

    def plan(self, bucket: tuple, batch: Batch, plan_full: Callable[[], HostMetadata],
             pack: Callable[[HostMetadata], tuple[np.ndarray, dict[str, np.ndarray]]]
             ) -> HostMetadata:
        """The step's host side. A fresh lone prompt of a known key: the key's stub, its bytes
        written for `batch`. Else `plan_full()` (`plan_metadata`); for a fresh lone prompt of a
        new key with room left, its bytes are also packed once (`pack`: into a buffer of their
        own, with its `host_views`) and kept as the key's template, and the stub is returned."""
        key = solo_key(bucket, batch)
        t = None if key is None else self._by_key.get(key)
        if t is None:
            host = plan_full()
            if key is None or len(self._by_key) >= self.max_templates:
                return host
            t = self._remember(key, host, *pack(host), batch.prefills[0].num_tokens)
        r, v = batch.prefills[0], t.views
        pages = np.array(r.pages, dtype=np.int64)
        v["input_ids"][: r.num_tokens] = r.token_ids
        v["slot_mapping"][: r.num_tokens] = pages[t.page_of] * self.page_size + t.offset
        v["page_table"][0, : len(pages)] = pages
        v["state_slots"][0] = r.state_slot
        for i, (_, dst) in enumerate(r.snapshots):
            v["snap_dst"][i] = dst
            v["chunk_snap_dst"][t.snap_chunk[i]] = dst
        return t.host

    def _remember(self, key: tuple, host: HostMetadata, packed: np.ndarray,
                  bucket_views: dict[str, np.ndarray], num_tokens: int) -> _Template:
        positions = np.arange(num_tokens, dtype=np.int64)
        stub = replace(host, arrays={"logits_idx": host.arrays["logits_idx"]}, packed=packed)
        # the chunk of each snapshot: where the plan put its (distinct) destination slot
        chunk_of = {d: c for c, d in enumerate(host.arrays["chunk_snap_dst"].tolist()) if d >= 0}
        snap_chunk = np.array([chunk_of[d] for d in host.arrays["snap_dst"].tolist()], np.int64)
        t = self._by_key[key] = _Template(stub, {n: bucket_views[n] for n in PATCHED},
                                          *np.divmod(positions, self.page_size), snap_chunk)
        return t
