"""A lone prompt's packed step computed directly (engine/prefill_lone.py) against the general
plan and packing (`plan_metadata` + `pack_prefill_step`): the same bytes and host ints over random
fresh prompts and follow-up suffixes (starts inside and at chunk boundaries, continued states,
restores), pages, logit rows and prefix-cache snapshots, in buckets of several padding rows,
chunk sizes, conv widths and page sizes; rows it does not take are refused."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pytest

from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.prefill_bucket import PrefillBucket, pack_prefill_step
from mambaserve.engine.prefill_lone import pack_lone_row
from mambaserve.metadata import plan_metadata

SCRATCH = 99


def _row(rng: random.Random, n: int, start: int, L: int, ps: int, samples: bool,
         snapshots: bool) -> Row:
    """n new tokens after `start` cached ones (a follow-up suffix continuing its state, restored
    from a random slot half the time; start 0: a fresh prompt); snapshots at a random choice of
    the row's chunk ends (absolute multiples of L inside it, and its last token)."""
    ids = [rng.randrange(3, 300) for _ in range(n)]
    end = start + n
    pages = rng.sample(range(80), -(-end // ps) + rng.choice([0, 0, 2]))
    ends = sorted({*range((start // L + 1) * L, end + 1, L), end}) if snapshots else []
    snaps = [(p, rng.randrange(100, 140)) for p in ends if rng.random() < 0.6][:3]
    restore = rng.randrange(40, 48) if start and rng.random() < 0.5 else -1
    r = Row.standalone(ids + ([7, 7] if not samples else []), start, rng.randrange(8), start > 0,
                       pages, snapshots=snaps, restore_from=restore)
    return r if samples else Row(r.request, start, n, snaps, restore, start > 0)


@pytest.mark.parametrize("rows,tokens,L,K,ps", [(2, 64, 16, 4, 4), (3, 40, 8, 4, 16),
                                                (2, 128, 32, 2, 8), (4, 33, 16, 3, 1)])
def test_lone_bytes_are_the_full_packing(rows, tokens, L, K, ps):
    rng = random.Random(rows * 1000 + tokens)
    for snapshots in (False, True):
        b = PrefillBucket(tokens=tokens, decodes=0, rows=rows, chunk_size=L, conv_kernel=K,
                          max_pages=(tokens + 3 * L) // ps + 4, snapshots=snapshots)
        lengths = {1, 2, K - 1, K, L - 1, L, L + 1, tokens - 1, tokens}
        lengths |= {rng.randrange(1, tokens + 1) for _ in range(12)}
        for n in sorted(x for x in lengths if 0 < x <= tokens):
            for start in (0, rng.randrange(1, L), L, L + rng.randrange(1, L), 2 * L):
                row = _row(rng, n, start, L, ps, rng.random() < 0.8, snapshots)
                if len(row.snapshots) > b.num_snapshots:
                    continue
                full = plan_metadata(Batch([row], []), chunk_size=L, conv_kernel=K,
                                     page_size=ps, scratch_page=SCRATCH)
                if full.num_chunks > b.chunks:
                    continue  # (a row that does not fit the bucket: never routed to it)
                want = pack_prefill_step(full, b, page_size=ps, scratch_page=SCRATCH)
                msg = f"{n} tokens from {start}"
                host, views = pack_lone_row(row, b, page_size=ps, scratch_page=SCRATCH)
                np.testing.assert_array_equal(host.packed, want, err_msg=msg)
                for f in fields(host):  # the host ints the replay and the sampler read
                    if f.name not in ("arrays", "packed", "row_spans"):
                        assert getattr(host, f.name) == getattr(full, f.name), (f.name, msg)
                np.testing.assert_array_equal(host.arrays["logits_idx"],
                                              full.arrays["logits_idx"])
                assert np.shares_memory(views["input_ids"], host.packed)
                # in the bucket's scratch buffer, over whatever step it held before
                again, _ = pack_lone_row(row, b, page_size=ps, scratch_page=SCRATCH, reuse=True)
                assert again.packed is b.scratch[0]
                np.testing.assert_array_equal(again.packed, want, err_msg=msg + ", reused")


def test_other_rows_are_refused():
    b = PrefillBucket(tokens=32, decodes=0, rows=2, chunk_size=16, conv_kernel=4, max_pages=8,
                      snapshots=False)
    ok = Row.standalone(list(range(3, 13)), 0, 1, False, [1, 2, 3])
    pack_lone_row(ok, b, page_size=4, scratch_page=SCRATCH)
    cases = [
        (Row.standalone(list(range(3, 40)), 0, 1, False, list(range(10))), "does not fit"),
        (Row.standalone(list(range(3, 13)), 0, 1, False, list(range(9))), "pages"),
    ]
    for row, msg in cases:
        with pytest.raises(ValueError, match=msg):
            pack_lone_row(row, b, page_size=4, scratch_page=SCRATCH)
    mixed = PrefillBucket(tokens=32, decodes=2, rows=2, chunk_size=16, conv_kernel=4,
                          max_pages=8, snapshots=False)
    with pytest.raises(ValueError, match="without decode rows"):
        pack_lone_row(ok, mixed, page_size=4, scratch_page=SCRATCH)
    snap = PrefillBucket(tokens=32, decodes=0, rows=2, chunk_size=4, conv_kernel=4,
                         max_pages=8, snapshots=True)
    for start, p in ((0, 6), (2, 2), (3, 14)):  # not a chunk end; the row's start; past its end
        bad = Row.standalone(list(range(3, 13)), start, 1, start > 0, [1, 2, 3, 4],
                             snapshots=[(p, 100)])
        with pytest.raises(ValueError, match="not a chunk end"):
            pack_lone_row(bad, snap, page_size=4, scratch_page=SCRATCH)
