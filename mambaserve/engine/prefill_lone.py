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
the padding `pack_prefill_step` puts around a step (`write_prefill_padding`, shared), so a length
seen for the first time skips the general planning and packing (the same bytes:
tests/engine/test_prefill_lone.py compares them on random prompts, suffixes and buckets).
"""

from __future__ import annotations

import numpy as np

from mambaserve.engine.batch import Row
from mambaserve.engine.prefill_bucket import PrefillBucket, write_prefill_padding
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
    write_prefill_padding(out, b, 1, N, Cr, page_size=page_size, scratch_page=scratch_page)
    ps, t = page_size, np.arange(N, dtype=np.int64)
    # ---- tokens --------------------------------------------------------------------------------
    out["input_ids"][:N] = row.token_array()
    pos = t + s
    out["positions"][:N] = pos
    page_of, offset = np.divmod(pos, ps)
    out["slot_mapping"][:N] = np.array(pages, dtype=np.int64)[page_of] * ps + offset
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
    out["conv_state_idx"][0] = ext(N + taps[:K1])
    # ---- the SSD chunk grid: the row's Cr chunks, its first holding the tokens before the next
    # multiple of L from the chunk's start ----------------------------------------------------
    tcp = out["token_chunk_pos"]
    first = min(N, L - off)  # the tokens of the row's first chunk
    tcp[:first] = t[:first]
    tcp[first:N] = t[first:] + off
    out["chunk_token_idx"].reshape(-1)[tcp[:N]] = t
    out["row_chunks"][0, :Cr] = np.arange(Cr, dtype=np.int64)
    out["row_num_chunks"][0] = Cr
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
