"""Triton SSD (Mamba2) chunked scan over the flat multi-row prefill stream.

Same chunk plan as the reference (`mambaserve.ops.ssd`): chunks cut at absolute multiples of
chunk_size, never spanning rows, described by host-built metadata. Four launches in order: dt and
its cumulative sum per chunk (0), state passing along each row's chunks (S), C·Bᵀ per chunk and
group (CB), and the output tiles (C). `SsdScan` holds one scan's buffers and its launches as
separate methods (a benchmark can time a prefix of them); `ssd_chunk_scan_varlen_triton` runs
them all; the kernels are in `ssd_kernels.py`. The algorithm, grids, buffers and measurements are
in docs/kernels.md ("SSD chunked scan"); launch parameters are the `tuning` entry "ssd".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.ssd_kernels import (
    _chunk_cb_kernel,
    _chunk_dt_kernel,
    _chunk_scan_kernel,
    _chunk_state_passing_kernel,
)


def _pow2_at_most(v: int, hi: int) -> int:
    return min(hi, max(16, triton.next_power_of_2(v)))


def _split_p(P: int, hi: int = 128) -> tuple[int, int]:
    """Launch C's column tiles for head_dim P: (BLOCK_P, BLOCK_P2). A P that is not a power of two
    is covered by two tiles in one program where that pads less than one tile of the next power
    of two (80 -> 64 + 16, not 128); otherwise (BLOCK_P, 0)."""
    one = _pow2_at_most(P, hi)
    lo = min(hi, max(16, 1 << (P.bit_length() - 1)))
    if lo >= P or lo >= hi:
        return one, 0
    rest = _pow2_at_most(P - lo, hi)
    return (lo, rest) if lo + rest < one else (one, 0)


def _second_rows(P: int, block_p: int) -> int:
    """Launch S's second row tile for head_dim P past a first of block_p rows: the rest rounded
    up to a power of two where that is smaller than a second program's block_p rows (80 past 64:
    16), else 0 (P <= block_p, or a second program as wide)."""
    if P <= block_p:
        return 0
    rest = _pow2_at_most(P - block_p, block_p)
    return rest if rest < block_p and block_p + rest >= P else 0


def _check_block(name: str, v: int, hi: int | None = None):
    assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16, got {v}"
    assert hi is None or v <= hi, f"{name} must be <= {hi}, got {v}"


class SsdScan:
    """One chunked scan: its inputs checked, launch parameters resolved (`tuning` entry "ssd",
    None knobs from the shapes) and buffers allocated on construction; `launches` are the four
    launches in the order they must run, and `run()` makes them all.

    Arguments as `mambaserve.ops.ssd.ssd_chunk_scan_varlen` (`out_chunks`: launches CB and C
    run on those chunks alone, one program column per entry), plus `contiguous_chunks`: True
    (default) assumes each chunk's tokens are consecutive in the stream (true of every
    build_metadata plan) and addresses them from the chunk's first token; False gathers each
    token through chunk_token_idx (any plan).
    """

    def __init__(self, x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                 has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks, row_num_chunks,
                 chunk_snap_dst=None, out_chunks=None, *, contiguous_chunks: bool = True):
        T, H, P = x.shape
        G, N = B.shape[1], B.shape[2]
        num_chunks, L = chunk_token_idx.shape
        R = row_chunks.shape[0]
        assert dt.shape == (T, H) and B.shape == (T, G, N) and C.shape == (T, G, N)
        assert A.shape == (H,) and D.shape == (H,) and dt_bias.shape == (H,)
        assert A.is_contiguous() and D.is_contiguous() and dt_bias.is_contiguous()
        assert H % G == 0, "heads must split evenly over groups"
        assert ssm_state.shape[1:] == (H, P, N), (ssm_state.shape, x.shape, B.shape)
        assert state_slots.shape == (R,) and has_initial_state.shape == (R,)
        assert row_num_chunks.shape == (R,) and token_chunk_pos.shape == (T,)
        assert L >= 16 and L & (L - 1) == 0, "chunk_size must be a power of two >= 16"
        if chunk_snap_dst is not None:
            assert chunk_snap_dst.shape == (num_chunks,), "chunk_snap_dst: one entry per chunk"
            assert ssm_state[0, 0].is_contiguous(), "snapshots need each head's [P, N] contiguous"
        for t in (state_slots, has_initial_state, chunk_token_idx, row_chunks, row_num_chunks,
                  chunk_snap_dst):
            assert t is None or t.is_contiguous()
        self.chunk_snap_dst = chunk_snap_dst
        if out_chunks is not None:
            assert out_chunks.dim() == 1 and out_chunks.is_contiguous(), "out_chunks: [n] chunk ids"
        self.out_chunks = out_chunks
        # launches CB and C: one program column per chunk, or per listed chunk
        self.out_grid = num_chunks if out_chunks is None else out_chunks.shape[0]
        self.x, self.dt, self.A, self.B, self.C, self.D = x, dt, A, B, C, D
        self.dt_bias, self.ssm_state, self.state_slots = dt_bias, ssm_state, state_slots
        self.has_initial_state, self.chunk_token_idx = has_initial_state, chunk_token_idx
        self.row_chunks, self.row_num_chunks = row_chunks, row_num_chunks
        self.contig = bool(contiguous_chunks)
        self.T, self.H, self.P, self.N, self.G, self.L, self.R = T, H, P, N, G, L, R
        self.num_chunks = num_chunks
        self.dt_lo, self.dt_hi = float(dt_limit[0]), float(dt_limit[1])

        k = tuning.config("ssd", x.device)
        self.bh = k["block_h_dt"] or min(32, triton.next_power_of_2(H))
        self.warps_dt = k["num_warps_dt"]
        # the split layouts' rules hold for 16-bit x (timed there, docs/kernels.md run 19); float32
        # operands keep the one-tile layouts (the split launches spill heavily with them)
        half = x.element_size() == 2
        self.bps = k["block_p_state"]
        self.bps2 = ((_second_rows(P, self.bps) if half else 0) if k["block_p2_state"] is None
                     else k["block_p2_state"])
        # a split program (more rows per tile) takes 64-wide N tiles (twice the programs) and
        # loads the next chunk's tiles ahead
        self.bns = k["block_n_state"] or (min(64, _pow2_at_most(N, 128)) if self.bps2
                                          else _pow2_at_most(N, 128))
        self.bls = k["block_l_state"] or L
        self.warps_state, self.stages_state = k["num_warps_state"], k["num_stages_state"]
        prefetch = self.bps2 > 0 and half if k["prefetch_state"] is None else k["prefetch_state"]
        self.prefetch_state = bool(prefetch) and self.contig and self.bls == L
        self.bcb = k["block_cb"] or min(L, 64)
        self.bkcb = k["block_k_cb"] or _pow2_at_most(N, 128)
        self.warps_cb = k["num_warps_cb"]
        self.bm = k["block_m_scan"] or min(L, 64)
        if k["block_p_scan"] is None and k["block_p2_scan"] is None:
            self.bpc, self.bpc2 = _split_p(P) if half else (_pow2_at_most(P, 128), 0)
        else:
            self.bpc = k["block_p_scan"] or _pow2_at_most(P, 128)
            self.bpc2 = k["block_p2_scan"] or 0
        self.bk = k["block_k_scan"] or (min(32, L) if self.bpc2 else 16)  # split: 32 (run 19)
        self.bnc = k["block_n_scan"] or _pow2_at_most(N, 128)
        self.warps_scan, self.stages_scan = k["num_warps_scan"], k["num_stages_scan"]
        for name, v, hi in (("block_p_state", self.bps, None), ("block_n_state", self.bns, None),
                            ("block_l_state", self.bls, L), ("block_cb", self.bcb, L),
                            ("block_k_cb", self.bkcb, None), ("block_m_scan", self.bm, L),
                            ("block_p_scan", self.bpc, None), ("block_k_scan", self.bk, L),
                            ("block_n_scan", self.bnc, None)):
            _check_block(name, v, hi)
        for name, first, second in (("state", self.bps, self.bps2),
                                    ("scan", self.bpc, self.bpc2)):
            if second:
                _check_block(f"block_p2_{name}", second)
                assert first < P <= first + second, (
                    f"block_p_{name} + block_p2_{name} must cover head_dim {P} with the first "
                    f"tile partly, got {first} + {second}")
        self.ip = "ieee" if x.dtype == torch.float32 else "tf32"
        self.cdt = tl.float32 if x.dtype == torch.float32 else (
            tl.float16 if x.dtype == torch.float16 else tl.bfloat16)

        dev = x.device
        self.y = torch.empty((T, H, P), dtype=x.dtype, device=dev)
        # chunk end states, then one initial state per row (written by S for rows that use one),
        # in x's dtype: launch C uses them only as dot operands of that dtype, so rounding them
        # when they are stored changes no output and halves their bytes for 16-bit x
        self.states = torch.empty((num_chunks + R, H, P, N), dtype=x.dtype, device=dev)
        self.empty = num_chunks == 0 or T == 0
        if self.empty:
            return
        f32 = {"dtype": torch.float32, "device": dev}
        self.dt_c = torch.empty((num_chunks, H, L), **f32)
        self.cum = torch.empty((num_chunks, H, L), **f32)
        self.clen = torch.empty((num_chunks,), dtype=torch.int32, device=dev)
        self.chunk_src = torch.empty((num_chunks,), dtype=torch.int64, device=dev)
        self.cb = torch.empty((num_chunks, G, L, L), **f32)

    @property
    def launches(self) -> tuple[tuple[str, object], ...]:
        """(name, launch) pairs in the order they must run; none for an empty batch."""
        if self.empty:
            return ()
        return (("dt", self.launch_dt), ("state", self.launch_state), ("cb", self.launch_cb),
                ("scan", self.launch_scan))

    def run(self) -> torch.Tensor:
        """Every launch in order; returns y."""
        for _, launch in self.launches:
            launch()
        return self.y

    def launch_dt(self) -> None:
        """0: dt = clamp(softplus(dt + dt_bias)) and cum = cumsum(dt A) per chunk, chunk lengths."""
        cti, dt = self.chunk_token_idx, self.dt
        _chunk_dt_kernel[(triton.cdiv(self.H, self.bh), self.num_chunks)](
            cti, dt, self.dt_bias, self.A, self.dt_c, self.cum, self.clen,
            self.T, self.H, self.dt_lo, self.dt_hi, cti.stride(0), *dt.stride(),
            L=self.L, BLOCK_H=self.bh, num_warps=self.warps_dt,
        )

    def launch_state(self) -> None:
        """S: every chunk's end state, each row's final state into its slot, the snapshots."""
        x, B, cti, ssm = self.x, self.B, self.chunk_token_idx, self.ssm_state
        P, N = self.P, self.N
        num_pb = 1 if self.bps2 else triton.cdiv(P, self.bps)
        _chunk_state_passing_kernel[(num_pb * triton.cdiv(N, self.bns), self.H, self.R)](
            x, B, cti, self.dt_c, self.cum, self.clen, self.states, self.chunk_src,
            ssm, self.state_slots, self.has_initial_state, self.row_chunks, self.row_num_chunks,
            self.chunk_snap_dst if self.chunk_snap_dst is not None else self.row_num_chunks,
            self.num_chunks, self.H, P, N, self.H // self.G,
            *x.stride(), *B.stride(), cti.stride(0), *ssm.stride(), self.row_chunks.stride(0),
            L=self.L, BLOCK_P=self.bps, BLOCK_P2=self.bps2, BLOCK_N=self.bns, BLOCK_L=self.bls,
            IP=self.ip,
            CONTIG=self.contig, SNAPS=self.chunk_snap_dst is not None,
            PREFETCH=self.prefetch_state,
            num_warps=self.warps_state, num_stages=self.stages_state,
        )

    def launch_cb(self) -> None:
        """CB: C·Bᵀ per chunk and group (lower-triangle tiles)."""
        B, C, cti = self.B, self.C, self.chunk_token_idx
        nb = self.L // self.bcb
        _chunk_cb_kernel[(nb * (nb + 1) // 2, self.G, self.out_grid)](
            B, C, cti, self.clen, self.cb, self._list,
            self.G, self.N, *B.stride(), *C.stride(), cti.stride(0),
            L=self.L, BLOCK=self.bcb, BLOCK_K=self.bkcb, IP=self.ip, CDT=self.cdt,
            CONTIG=self.contig, LISTED=self.out_chunks is not None, num_warps=self.warps_cb,
        )

    @property
    def _list(self) -> torch.Tensor:
        """Launches CB and C's chunk list (any tensor where they run on every chunk)."""
        return self.out_chunks if self.out_chunks is not None else self.clen

    def launch_scan(self) -> None:
        """C: the output tiles, y = inter-chunk + intra-chunk terms + D x."""
        x, C, y, cti = self.x, self.C, self.y, self.chunk_token_idx
        num_pb = 1 if self.bpc2 else triton.cdiv(self.P, self.bpc)
        _chunk_scan_kernel[(triton.cdiv(self.L, self.bm) * num_pb, self.H, self.out_grid)](
            x, C, self.D, cti, self.dt_c, self.cum, self.clen, self.cb, self.states,
            self.chunk_src, y, self._list,
            self.H, self.P, self.N, self.G, self.H // self.G,
            *x.stride(), *C.stride(), *y.stride(), cti.stride(0),
            L=self.L, BLOCK_M=self.bm, BLOCK_P=self.bpc, BLOCK_P2=self.bpc2, BLOCK_K=self.bk,
            BLOCK_N=self.bnc,
            IP=self.ip, CONTIG=self.contig, ONE_N_BLOCK=self.bnc >= self.N,
            LISTED=self.out_chunks is not None,
            num_warps=self.warps_scan, num_stages=self.stages_scan,
        )


def ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                                 has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks,
                                 row_num_chunks, chunk_snap_dst=None, out_chunks=None, *,
                                 contiguous_chunks: bool = True):
    """Same contract as `mambaserve.ops.ssd.ssd_chunk_scan_varlen` (`contiguous_chunks`: see
    `SsdScan`)."""
    return SsdScan(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                   has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks, row_num_chunks,
                   chunk_snap_dst, out_chunks, contiguous_chunks=contiguous_chunks).run()
