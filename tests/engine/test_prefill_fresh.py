"""A fresh lone prompt's packed step computed directly (engine/prefill_fresh.py) against the
general plan and packing (`plan_metadata` + `pack_prefill_step`): the same bytes and host ints
over random lengths, pages, logit rows and prefix-cache snapshots, in buckets of several padding
rows, chunk sizes, conv widths and page sizes; steps it does not take are refused."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pytest

from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.prefill_bucket import PrefillBucket, pack_prefill_step
from mambaserve.engine.prefill_fresh import pack_fresh_row
from mambaserve.metadata import plan_metadata

SCRATCH = 99


def _row(rng: random.Random, n: int, L: int, ps: int, samples: bool, snapshots: bool) -> Row:
    ids = [rng.randrange(3, 300) for _ in range(n)]
    pages = rng.sample(range(60), -(-n // ps) + rng.choice([0, 0, 2]))
    ends = sorted({*range(L, n + 1, L), n}) if snapshots else []
    snaps = [(p, rng.randrange(100, 140)) for p in ends if rng.random() < 0.6][:3]
    r = Row.standalone(ids + ([7, 7] if not samples else []), 0, rng.randrange(8), False, pages,
                       snapshots=snaps)
    return r if samples else Row(r.request, 0, n, snaps, -1, False)


@pytest.mark.parametrize("rows,tokens,L,K,ps", [(2, 64, 16, 4, 4), (3, 40, 8, 4, 16),
                                                (2, 128, 32, 2, 8), (4, 33, 16, 3, 1)])
def test_fresh_bytes_are_the_full_packing(rows, tokens, L, K, ps):
    rng = random.Random(rows * 1000 + tokens)
    for snapshots in (False, True):
        b = PrefillBucket(tokens=tokens, decodes=0, rows=rows, chunk_size=L, conv_kernel=K,
                          max_pages=tokens // ps + 4, snapshots=snapshots)
        lengths = {1, 2, K - 1, K, L - 1, L, L + 1, tokens - 1, tokens}
        lengths |= {rng.randrange(1, tokens + 1) for _ in range(12)}
        for n in sorted(x for x in lengths if 0 < x <= tokens):
            row = _row(rng, n, L, ps, samples=rng.random() < 0.8, snapshots=snapshots)
            full = plan_metadata(Batch([row], []), chunk_size=L, conv_kernel=K, page_size=ps,
                                 scratch_page=SCRATCH)
            want = pack_prefill_step(full, b, page_size=ps, scratch_page=SCRATCH)
            host, views = pack_fresh_row(row, b, page_size=ps, scratch_page=SCRATCH)
            np.testing.assert_array_equal(host.packed, want, err_msg=f"{n} tokens")
            # in the bucket's scratch buffer, over whatever step it held before
            again, _ = pack_fresh_row(row, b, page_size=ps, scratch_page=SCRATCH, reuse=True)
            assert again.packed is b.scratch[0]
            np.testing.assert_array_equal(again.packed, want, err_msg=f"{n} tokens, reused")
            for f in fields(host):  # the host ints the replay and the sampler read
                if f.name not in ("arrays", "packed", "row_spans"):
                    assert getattr(host, f.name) == getattr(full, f.name), (f.name, n)
            np.testing.assert_array_equal(host.arrays["logits_idx"], full.arrays["logits_idx"])
            assert views["input_ids"].base is host.packed.base or \
                np.shares_memory(views["input_ids"], host.packed)


def test_other_rows_are_refused():
    b = PrefillBucket(tokens=32, decodes=0, rows=2, chunk_size=16, conv_kernel=4, max_pages=8,
                      snapshots=False)
    ok = Row.standalone(list(range(3, 13)), 0, 1, False, [1, 2, 3])
    pack_fresh_row(ok, b, page_size=4, scratch_page=SCRATCH)
    cases = [
        (Row.standalone(list(range(3, 13)), 4, 1, True, [1, 2, 3, 4]), "fresh row"),  # a suffix
        (Row.standalone(list(range(3, 13)), 0, 1, False, [1, 2, 3], restore_from=5), "fresh"),
        (Row.standalone(list(range(3, 40)), 0, 1, False, list(range(10))), "does not fit"),
        (Row.standalone(list(range(3, 13)), 0, 1, False, list(range(9))), "pages"),
    ]
    for row, msg in cases:
        with pytest.raises(ValueError, match=msg):
            pack_fresh_row(row, b, page_size=4, scratch_page=SCRATCH)
    mixed = PrefillBucket(tokens=32, decodes=2, rows=2, chunk_size=16, conv_kernel=4,
                          max_pages=8, snapshots=False)
    with pytest.raises(ValueError, match="without decode rows"):
        pack_fresh_row(ok, mixed, page_size=4, scratch_page=SCRATCH)
    snap = PrefillBucket(tokens=32, decodes=0, rows=2, chunk_size=4, conv_kernel=4,
                         max_pages=8, snapshots=True)
    bad = Row.standalone(list(range(3, 13)), 0, 1, False, [1, 2, 3], snapshots=[(6, 100)])
    with pytest.raises(ValueError, match="not a chunk end"):
        pack_fresh_row(bad, snap, page_size=4, scratch_page=SCRATCH)
