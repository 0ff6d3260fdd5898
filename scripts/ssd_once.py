"""One SSD chunked-scan forward at a Nemotron-Nano-9B-v2 Mamba-layer shape (ours, then mamba_ssm's
`mamba_chunk_scan_combined` when importable), for Nsight Compute (GPU machine, repo root). Both
are warmed up (compiled, autotuned) first; only the one call of each made between
cudaProfilerStart and cudaProfilerStop is profiled:

    PYTHONPATH=.:.peer/mamba_ssm-2.3.2.post1 ncu --clock-control none --profile-from-start off \\
        --kernel-name regex:'_chunk_scan|_chunk_state|_state_passing' \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 scripts/ssd_once.py 1x8192
"""

from __future__ import annotations

import sys

import torch

H, P, N, G, K, L = 128, 80, 128, 8, 4, 128
D_INNER = H * P


def scan_inputs(shape: str):
    """The scan's inputs at the 9B layer shapes for `shape` ("ROWSxTOKENS", rows from zero, bf16;
    x, B, C split views of one buffer as in the mixer): (x, dt, A, B, C, D, dt_bias, dt_limit,
    ssm_state, state_slots, has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks,
    row_num_chunks), in `ssd_chunk_scan_varlen`'s order."""
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata

    nrows, seqlen = (int(v) for v in shape.split("x"))
    batch = Batch(prefills=[Row.standalone([1] * seqlen, 0, i, False, [0]) for i in range(nrows)],
                  decodes=[])
    meta = build_metadata(batch, chunk_size=L, conv_kernel=K, page_size=1 << 20, scratch_page=0,
                          device="cuda")
    T = meta.num_prefill_tokens
    g = torch.Generator(device="cuda").manual_seed(1)
    xbc = torch.randn(T, H * P + 2 * G * N, device="cuda", dtype=torch.bfloat16, generator=g)
    x = xbc[:, :H * P].view(T, H, P)
    Bm = xbc[:, H * P: H * P + G * N].view(T, G, N)
    Cm = xbc[:, H * P + G * N:].view(T, G, N)
    dt = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g) - 1
    A = -torch.rand(H, device="cuda", generator=g) * 2 - 0.05
    D = torch.randn(H, device="cuda", generator=g)
    dt_bias = torch.randn(H, device="cuda", generator=g) * 0.5
    ssm = torch.zeros(nrows + 1, H, P, N, device="cuda")
    pm = meta.prefill
    return (x, dt, A, Bm, Cm, D, dt_bias, (0.0, float("inf")), ssm,
            pm.state_slots.to(torch.int32), pm.has_initial_state, pm.chunk_token_idx,
            pm.token_chunk_pos, pm.row_chunks, pm.row_num_chunks)


def main(shape: str) -> None:
    from mambaserve.ops.triton.ssd import ssd_chunk_scan_varlen_triton

    nrows, seqlen = (int(v) for v in shape.split("x"))
    inputs = scan_inputs(shape)
    x, dt, A, Bm, Cm, D, dt_bias = inputs[:7]
    calls = [lambda: ssd_chunk_scan_varlen_triton(*inputs)]
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        calls.append(lambda: mamba_chunk_scan_combined(
            x.reshape(nrows, seqlen, H, P), dt.reshape(nrows, seqlen, H), A,
            Bm.reshape(nrows, seqlen, G, N), Cm.reshape(nrows, seqlen, G, N), L, D=D,
            dt_bias=dt_bias, dt_softplus=True, return_final_states=True))
    except Exception as e:  # noqa: BLE001
        print(f"mamba_ssm not importable ({type(e).__name__}: {e}): ours only")
    for fn in calls:  # compile / autotune outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "1x8192")
