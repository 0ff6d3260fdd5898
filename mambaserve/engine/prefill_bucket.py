"""A prefill / mixed-step graph's bucket (engine/prefill_graph.py has the design): its fixed
shapes and the parts of its static byte buffer (`PrefillBucket`), a step planned eagerly packed
into that layout with padding around it (`pack_prefill_step`), and the captured metadata over
the buffer's device views (`bucket_metadata`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from mambaserve.host_upload import layout
from mambaserve.metadata import ForwardMetadata, HostMetadata, PrefillMetadata

_I64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)


@dataclass(frozen=True)
class PrefillBucket:
    """The fixed shapes of one prefill / mixed graph."""

    tokens: int  # prefill tokens, real + padding
    decodes: int  # decode rows, real + padding
    rows: int  # prefill rows: up to rows - 1 real ones, then padding rows
    chunk_size: int
    conv_kernel: int
    max_pages: int
    snapshots: bool  # prefix caching on: prefill and decode snapshots are captured

    @property
    def num_tokens(self) -> int:
        return self.tokens + self.decodes

    @property
    def num_rows(self) -> int:
        return self.rows + self.decodes

    @property
    def chunks(self) -> int:
        """A row of n tokens starting at offset s of a chunk spans ceil((s + n) / L) <= (n + 2L
        - 2) / L chunks; the padding rows add one chunk each, plus the padding tokens' chunks:
        at most tokens / L + 2 * rows - 1 in all."""
        return self.tokens // self.chunk_size + 2 * self.rows - 1

    @property
    def chunks_per_row(self) -> int:
        return (self.tokens + 2 * self.chunk_size - 2) // self.chunk_size

    @property
    def num_snapshots(self) -> int:
        """Prefill snapshots: each row takes at most one per chunk_size multiple it reaches
        (snapshot positions are multiples of the interval, itself a multiple of the chunk
        size), at most three (two for the tree, the latest)."""
        if not self.snapshots:
            return 0
        real = self.rows - 1
        return min(3 * real, real + self.tokens // self.chunk_size)

    @property
    def num_logits(self) -> int:
        return self.rows - 1 + self.decodes

    @cached_property
    def specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The parts of the static buffer, in order (the page table, the largest, last)."""
        T, Tp, P, D, R = self.num_tokens, self.tokens, self.rows, self.decodes, self.num_rows
        K, S = self.conv_kernel, self.num_snapshots
        return {
            "input_ids": (_I64, (T,)), "positions": (_I64, (T,)), "token_row": (_I64, (T,)),
            "slot_mapping": (_I64, (T,)), "state_slots": (_I64, (R,)),
            "decode_snap_dst": (_I64, (D,)), "logits_idx": (_I64, (self.num_logits,)),
            "conv_window_idx": (_I64, (Tp, K)), "conv_state_idx": (_I64, (P, K - 1)),
            "chunk_token_idx": (_I64, (self.chunks, self.chunk_size)),
            "token_chunk_pos": (_I64, (Tp,)), "row_chunks": (_I64, (P, self.chunks_per_row)),
            "row_num_chunks": (_I64, (P,)),
            "snap_conv_idx": (_I64, (S, K - 1)), "snap_dst": (_I64, (S,)),
            "chunk_snap_dst": (_I64, (self.chunks,)),
            "restore_src": (_I64, (P - 1,)), "restore_dst": (_I64, (P - 1,)),
            "has_initial_state": (_BOOL, (P,)), "page_table": (_I64, (R, self.max_pages)),
        }

    @cached_property
    def _layout(self) -> tuple[dict[str, int], int]:
        return layout(self.specs)

    @property
    def nbytes(self) -> int:
        return self._layout[1]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Named, typed views of a host byte buffer in this bucket's layout."""
        offsets = self._layout[0]
        return {name: buf[offsets[name]: offsets[name] + dtype.itemsize * math.prod(shape)]
                .view(dtype).reshape(shape) for name, (dtype, shape) in self.specs.items()}

    @cached_property
    def scratch(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A host buffer of this bucket's own and its views, which `pack_prefill_step(...,
        reuse=True)` fills in place (the views are built once, not every step)."""
        buf = np.zeros(self.nbytes, np.uint8)
        return buf, self.host_views(buf)

    def zeroed_buffer(self, reuse: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A zeroed host buffer in this bucket's layout and its views: `scratch`, cleared
        (`reuse`), or a new one of the caller's own."""
        if reuse:
            buf, out = self.scratch
            buf.fill(0)
            return buf, out
        buf = np.zeros(self.nbytes, np.uint8)
        return buf, self.host_views(buf)


def pack_prefill_step(host: HostMetadata | None, b: PrefillBucket, *, page_size: int,
                      scratch_page: int, reuse: bool = False) -> np.ndarray:
    """The bucket's host byte buffer (its one upload) for a step planned eagerly as `host`
    (None: all padding, for capture): the eager arrays embedded in the bucket's layout, padding
    around them (engine/prefill_graph.py's docstring). `b.host_views(buf)` names its parts.
    `reuse`: fill the bucket's own buffer (`b.scratch`) and return it; it holds the step only
    until the next packing into this bucket (the runner copies it into the step's upload at
    once)."""
    z = HostMetadata(0, 0, 0, 0, 0, 0, 0, 0, 0, {}) if host is None else host
    Pr, Tr, Dr, Cr = z.num_prefills, z.num_prefill_tokens, z.num_decodes, z.num_chunks
    P, Tp, D, C, L, K1 = b.rows, b.tokens, b.decodes, b.chunks, b.chunk_size, b.conv_kernel - 1
    if not (Pr < P and Tr <= Tp and Dr <= D and Cr <= C and z.num_prefill_snapshots
            <= b.num_snapshots and (Pr or host is None)):
        raise ValueError(f"step of {Pr} prefill rows / {Tr} tokens, {Dr} decode rows, {Cr} "
                         f"chunks, {z.num_prefill_snapshots} snapshots does not fit {b}")
    a = z.arrays
    n_pad = Tp - Tr
    dec = slice(Tp, Tp + Dr)  # the real decode tokens / rows in the bucket
    ps, scratch = page_size, scratch_page

    def get(name: str, default_shape=(0,)) -> np.ndarray:
        return a[name] if name in a else np.zeros(default_shape, np.int64)

    def ext(e: np.ndarray) -> np.ndarray:  # an eager extended-stream index -> the bucket's
        return np.where(e < Pr * K1, e, e + (P - Pr) * K1)

    buf, out = b.zeroed_buffer(reuse)
    write_prefill_padding(out, b, Pr, Tr, Cr, page_size=ps, scratch_page=scratch)
    # ---- tokens: real prefill | padding prefill (from position 0) | real decode | padding ----
    for name in ("input_ids", "positions", "slot_mapping", "token_row"):
        eager, o = get(name), out[name]
        o[:Tr], o[dec] = eager[:Tr], eager[Tr:]
    out["slot_mapping"][Tp + Dr:] = scratch * ps
    out["token_row"][Tp:] = P + np.arange(D)
    # ---- rows: real prefill | padding prefill | real decode | padding decode ------------------
    slots, table = out["state_slots"], out["page_table"]
    slots[:] = -1
    table[:] = scratch
    if host is not None:
        slots[:Pr], slots[P: P + Dr] = a["state_slots"][:Pr], a["state_slots"][Pr:]
        width = a["page_table"].shape[1]
        if width > b.max_pages:
            raise ValueError(f"a row needs {width} pages, the graph holds {b.max_pages}")
        table[:Pr, :width], table[P: P + Dr, :width] = a["page_table"][:Pr], a["page_table"][Pr:]
    out["decode_snap_dst"][:] = -1
    out["decode_snap_dst"][:Dr] = get("decode_snap_dst")
    li = get("logits_idx")
    out["logits_idx"][: len(li)] = np.where(li >= Tr, li + n_pad, li)
    # ---- prefill rows: conv windows, the SSD chunk grid, snapshots, restores -----------------
    out["has_initial_state"][:Pr] = a.get("has_initial_state", np.zeros(0, np.bool_))
    out["conv_window_idx"][:Tr] = ext(get("conv_window_idx", (0, K1 + 1)))
    out["conv_state_idx"][:Pr] = ext(get("conv_state_idx", (0, K1)))
    eager_cti = get("chunk_token_idx", (0, L))
    out["chunk_token_idx"][:Cr] = np.where(eager_cti == Tr, Tp, eager_cti)
    out["token_chunk_pos"][:Tr] = get("token_chunk_pos")
    eager_rc = get("row_chunks", (0, 0))
    out["row_chunks"][:Pr, : eager_rc.shape[1]] = np.where(eager_rc == Cr, C, eager_rc)
    out["row_num_chunks"][:Pr] = get("row_num_chunks")
    Sr = len(get("snap_dst"))
    out["snap_conv_idx"][:Sr] = ext(get("snap_conv_idx", (0, K1)))
    out["snap_dst"][:] = -1
    out["snap_dst"][:Sr] = get("snap_dst")
    out["chunk_snap_dst"][:] = -1  # padding chunks: none
    out["chunk_snap_dst"][:Cr] = get("chunk_snap_dst")
    n_res = len(get("restore_src"))  # padding entries are never read (sliced to n_res)
    out["restore_src"][:n_res], out["restore_dst"][:n_res] = get("restore_src"), \
        get("restore_dst")
    return buf


def write_prefill_padding(out: dict[str, np.ndarray], b: PrefillBucket, Pr: int, Tr: int,
                          Cr: int, *, page_size: int, scratch_page: int) -> None:
    """The padding around a step's Pr real prefill rows of Tr tokens and Cr chunks, in the
    bucket's views `out` (engine/prefill_graph.py's docstring): the padding tokens (from position
    0 of the scratch page), their row's conv windows, every padding row's conv state, and the
    chunk grid past the real rows' (its other entries filled with the padding values Tp / C, which
    the real rows' then overwrite)."""
    P, Tp, C, L, K1 = b.rows, b.tokens, b.chunks, b.chunk_size, b.conv_kernel - 1
    n_pad, pad_row, ps = Tp - Tr, P - 1, page_size
    pad_pos = np.arange(n_pad, dtype=np.int64)
    # positions within the first page: the padding row's attention reads page-table column 0
    # only (a position past max_model_len would index past its page-table row)
    out["positions"][Tr:Tp] = pad_pos % ps
    out["slot_mapping"][Tr:Tp] = scratch_page * ps + pad_pos % ps
    out["token_row"][Tr:Tp] = pad_row
    u = pad_pos[:, None] + np.arange(K1 + 1)  # the padding row's windows
    out["conv_window_idx"][Tr:Tp] = np.where(u < K1, pad_row * K1 + u, P * K1 + Tr + u - K1)
    # padding rows keep their (scratch) window: u < K1 of their own saved inputs; the last
    # row's ends at n_pad, inside the padding tokens from u = K1 on
    pad_rows = np.arange(Pr, P, dtype=np.int64)[:, None]
    u = np.where(pad_rows == pad_row, n_pad, 0) + np.arange(K1)
    out["conv_state_idx"][Pr:] = np.where(u < K1, pad_rows * K1 + u, P * K1 + Tr + u - K1)
    cti, tcp = out["chunk_token_idx"], out["token_chunk_pos"]
    rc, rnc = out["row_chunks"], out["row_num_chunks"]
    cti[:] = Tp
    rc[:] = C
    # padding rows: one empty chunk each but the last, whose tokens fill aligned chunks
    empty = P - 1 - Pr
    rc[Pr:pad_row, 0] = np.arange(Cr, Cr + empty)
    rnc[Pr:pad_row] = 1
    c = Cr + empty  # the padding row's first chunk
    k = max(1, -(-n_pad // L))
    assert c + k <= C, (c + k, C)
    rc[pad_row, :k] = np.arange(c, c + k)
    rnc[pad_row] = k
    cti.reshape(-1)[c * L: c * L + n_pad] = np.arange(Tr, Tp)
    tcp[Tr:] = c * L + pad_pos


def bucket_metadata(parts: dict[str, torch.Tensor], b: PrefillBucket, *,
                    max_kv_len: int, dense: bool = False) -> ForwardMetadata:
    """The captured metadata of bucket `b` over its views `parts` of the static buffer. No
    restore runs inside (num_restores = 0): the runner copies them before the replay. `dense`:
    the prefill part is one fresh row for the attention (a fresh lone prompt's variant: its
    real tokens, then the padding tokens no real token sees)."""
    t, P = parts, b.rows
    prefill = PrefillMetadata(
        num_rows=P, num_tokens=b.tokens, num_chunks=b.chunks, num_snapshots=b.num_snapshots,
        num_restores=0, state_slots=t["state_slots"][:P],
        row_spans=((0, b.tokens, 0),) if dense else None,
        restore_src=t["restore_src"][:0], restore_dst=t["restore_dst"][:0],
        **{n: t[n] for n in ("has_initial_state", "conv_window_idx", "conv_state_idx",
                             "chunk_token_idx", "token_chunk_pos", "row_chunks",
                             "row_num_chunks", "snap_conv_idx", "snap_dst",
                             "chunk_snap_dst")})
    return ForwardMetadata(
        num_tokens=b.num_tokens, num_decodes=b.decodes, max_kv_len=max_kv_len,
        num_decode_snapshots=b.decodes if b.snapshots else 0, prefill=prefill,
        **{n: t[n] for n in ("input_ids", "positions", "token_row", "state_slots", "page_table",
                             "slot_mapping", "logits_idx", "decode_snap_dst")})
