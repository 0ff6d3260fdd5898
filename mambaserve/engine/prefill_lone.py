"""A lone prompt's packed prefill-graph step, computed for it directly.

A lone prompt (one prefill row, no decode rows: `prefill_template.lone_prompt`) is the
single-request case: a new request's first step (TTFT), or a follow-up turn's uncached suffix
after a prefix-cache hit. Its length is mostly one no template holds: a server's prompts and
turns vary in length. For one row every index of `plan_metadata` has a closed form in its start
s and token count N (chunk size L, conv taps K1 = conv_kernel - 1): positions s .. s + N - 1;
token t's conv window t .. t + K1 and the row's conv state N .. N + K1 - 1 (of the stream of its
K1 saved inputs, then its tokens); its chunks cut at absolute multiples of L, the first from its
first token (token t at chunk position t while in the first chunk, t + s mod L after); a snapshot
at position p saving chunk (p - 1) // L - s // L and the conv inputs p - s .. p - s + K1 - 1; a
restore into the row's state slot. `pack_lone_row` writes those into the bucket's layout with
the padding `pack_prefill_step` puts around a step, so a length seen for the first time skips
the general planning and packing (the same bytes: tests/engine/test_prefill_lone.py compares
them on random prompts, suffixes and buckets).
"""

from __future__ import annotations

import numpy as np

from mambaserve.engine.batch import Row
from mambaserve.engine.prefill_bucket import PrefillBucket
from mambaserve.metadata import HostMetadata


def pack_lone_row(row: Row, b: PrefillBucket, *, page_size: int, scratch_page: int,
                  reuse: bool = False) -> tuple[HostMetadata, dict[str, np.ndarray]]:
    """`pack_prefill_step(plan_metadata(batch of `row` alone), b)`'s bytes, in a buffer of their
    own (`reuse`: in the bucket's scratch buffer, as `pack_prefill_step(..., reuse=True)`: until
    the next packing into the bucket): the stub a template hands on (`HostMetadata.packed`,
    arrays `logits_idx` only) and the buffer's named views (`b.host_views`)."""
    N, s, L, K1 = row.num_tokens, row.start, b.chunk_size, b.conv_kernel - 1
    P, Tp, C = b.rows, b.tokens, b.chunks
    if b.decodes:
        raise ValueError("pack_lone_row takes a bucket without decode rows")
    off = s % L  # where the row's first chunk is cut: it ends at the next multiple of L
    Cr, snaps = (s + N - 1) // L - s // L + 1, row.snapshots
    if not (0 < N <= Tp and P > 1 and Cr <= C and len(snaps) <= b.num_snapshots):
        raise ValueError(f"a row of {N} tokens, {Cr} chunks, {len(snaps)} snapshots does not "
                         f"fit {b}")
    pages = row.pages or [scratch_page]  # (plan_metadata's page table is never empty)
    if len(pages) > b.max_pages:
        raise ValueError(f"a row needs {len(pages)} pages, the graph holds {b.max_pages}")
    buf, out = b.zeroed_buffer(reuse)
    n_pad, pad_row, ps = Tp - N, P - 1, page_size
    t, pad_pos = np.arange(N, dtype=np.int64), np.arange(n_pad, dtype=np.int64)
    # ---- tokens: the row's, then the padding row's (positions within the first page) ----------
    out["input_ids"][:N] = row.token_array()
    pos = t + s
    out["positions"][:N] = pos
    out["positions"][N:] = pad_pos % ps
    page_of, offset = np.divmod(pos, ps)
    out["slot_mapping"][:N] = np.array(pages, dtype=np.int64)[page_of] * ps + offset
    out["slot_mapping"][N:] = scratch_page * ps + pad_pos % ps
    out["token_row"][N:] = pad_row
    # ---- rows ----------------------------------------------------------------------------------
    out["state_slots"][:] = -1
    out["state_slots"][0] = row.state_slot
    out["page_table"][:] = scratch_page
    out["page_table"][0, : len(pages)] = pages
    logits_idx = np.array(row.logits_positions, dtype=np.int64)
    out["logits_idx"][: len(logits_idx)] = logits_idx
    out["has_initial_state"][0] = bool(row.has_initial_state)
    restores = int(row.restore_from >= 0)
    if restores:
        out["restore_src"][0], out["restore_dst"][0] = row.restore_from, row.state_slot

    # ---- conv windows over [P * K1 saved inputs | Tp tokens]: offset u of the row's windows is
    # its saved input u below K1, else token u - K1 ----------------------------------------------
    def ext(u: np.ndarray) -> np.ndarray:
        return np.where(u < K1, u, u + (P - 1) * K1)

    taps = np.arange(K1 + 1, dtype=np.int64)
    out["conv_window_idx"][:N] = ext(t[:, None] + taps)
    u = pad_pos[:, None] + taps  # the padding row's windows
    out["conv_window_idx"][N:] = np.where(u < K1, pad_row * K1 + u, P * K1 + N + u - K1)
    out["conv_state_idx"][0] = ext(N + taps[:K1])
    pad_rows = np.arange(1, P, dtype=np.int64)[:, None]
    u = np.where(pad_rows == pad_row, n_pad, 0) + taps[:K1]
    out["conv_state_idx"][1:] = np.where(u < K1, pad_rows * K1 + u, P * K1 + N + u - K1)
    # ---- the SSD chunk grid: the row's Cr chunks (its first holds the tokens before the next
    # multiple of L, from the chunk's start), an empty chunk per empty padding row, the padding
    # row's tokens in aligned chunks ----------------------------------------------------------
    cti, tcp = out["chunk_token_idx"].reshape(-1), out["token_chunk_pos"]
    cti[:] = Tp
    first = min(N, L - off)  # the tokens of the row's first chunk
    tcp[:first] = t[:first]
    tcp[first:N] = t[first:] + off
    cti[tcp[:N]] = t
    rc, rnc = out["row_chunks"], out["row_num_chunks"]
    rc[:] = C
    rc[0, :Cr] = np.arange(Cr, dtype=np.int64)
    rnc[0] = Cr
    empty = P - 2
    rc[1:pad_row, 0] = np.arange(Cr, Cr + empty, dtype=np.int64)
    rnc[1:pad_row] = 1
    c = Cr + empty
    k = max(1, -(-n_pad // L))
    assert c + k <= C, (c + k, C)
    rc[pad_row, :k] = np.arange(c, c + k, dtype=np.int64)
    rnc[pad_row] = k
    cti[c * L: c * L + n_pad] = np.arange(N, Tp, dtype=np.int64)
    tcp[N:] = c * L + pad_pos
    # ---- prefix-cache snapshots: chunk ends inside the row, or its last token ----------------
    out["snap_dst"][:] = -1
    out["chunk_snap_dst"][:] = -1
    for i, (p, dst) in enumerate(snaps):
        end = p - s  # the snapshot's offset in the row
        if not 0 < end <= N or (p % L and end != N):
            raise ValueError(f"snapshot position {p} is not a chunk end of its row")
        out["chunk_snap_dst"][(p - 1) // L - s // L] = dst
        out["snap_conv_idx"][i] = ext(end + taps[:K1])
        out["snap_dst"][i] = dst
    return HostMetadata(
        num_prefills=1, num_prefill_tokens=N, num_decodes=0, num_tokens=N, num_chunks=Cr,
        max_kv_len=s + N, num_prefill_snapshots=len(snaps), num_decode_snapshots=0,
        num_restores=restores, arrays={"logits_idx": logits_idx}, packed=buf), out
