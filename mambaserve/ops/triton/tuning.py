"""Launch parameters of the Triton kernels (block sizes, warps, pipeline stages), per device.

Every launcher reads its kernel's entry with `config(kernel, device)` when it is called; nothing
here imports Triton. An entry maps knob names to values; `None` means "derived from the shapes by
the launcher" (each launcher states its rule where it reads the knob). The table is keyed by the
device's CUDA compute capability; a device without an entry of its own (and the CPU, where the
kernels run under the interpreter) uses `DEFAULT`. The values come from sweeps on an H200
(sm_90), the rules of "fp8_gemv" and "moe_experts" from sweeps on an H100 (sm_90 as well);
docs/kernels.md has the measurements.

Sweeps and tests change knobs with `override`, never through launcher arguments:

    with tuning.override("ssd", block_m_scan=32, num_warps_scan=8):
        ssd_chunk_scan_varlen_triton(...)

Overrides apply on every device, nest (the innermost value of a knob wins), are local to the
current thread / asyncio context, and reject knob names the kernel does not have.

A whole process (a benchmark, a server and its tensor-parallel workers, which inherit the
environment) takes knob values from the environment variable MAMBASERVE_TUNING, entries
`kernel.knob=value` separated by commas, values Python literals (`None`, `True`, numbers):

    MAMBASERVE_TUNING=fp8_gemv.prefetch_bytes=0,ssd.num_warps_scan=8 mambaserve bench ...

They sit on top of the table and below `override`, read once per process; an unknown kernel or
knob, or a value that is not a literal, is a one-line ValueError (the CLI checks it at start).
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

# Tuned on an H200 and an H100 (sm_90). Knobs set to None follow the launcher's shape rule.
SM90: Mapping[str, Mapping[str, object]] = MappingProxyType({
    # relu2: BLOCK elements per program
    "relu2": MappingProxyType({"block": 4096, "num_warps": 8}),
    # silu(gate) * up: BLOCK channels of one row per program (capped at pow2(I)); not swept
    "silu_mul": MappingProxyType({"block": 2048, "num_warps": 4}),
    # gated RMSNorm: None = max(1, min(8, BLOCK // 256)), BLOCK = next pow2 of the group size;
    # the whole-row launch that writes FP8 rows: None = min(32, max(4, tile // 512)); up to
    # fp8_unfused_rows rows the per-group norm and the quantization launch run instead (faster
    # there on an H100: docs/kernels.md, "FP8 activation quantization")
    "gated_rmsnorm": MappingProxyType({"num_warps": None, "fp8_num_warps": None,
                                       "fp8_unfused_rows": 32}),
    # the gate without a norm (y * silu(z)): BLOCK channels of one token per program (capped at
    # the next power of two of the width); not swept
    "gated_silu": MappingProxyType({"block": 1024, "num_warps": 4}),
    # the sampler without filters: vocabulary entries per program; not swept
    "sample_rows": MappingProxyType({"block_v": 2048, "num_warps": 4}),
    # RMSNorm: None = 16 from BLOCK_D 16384, else max(1, min(8, BLOCK_D // 512))
    "rms_norm": MappingProxyType({"num_warps": None}),
    # decode conv step: channels per program
    "conv1d_update": MappingProxyType({"block_d": 256, "num_warps": 4}),
    # prefill conv: launch 1 (block_t tokens x block_d channels; lookahead inputs loaded ahead in
    # the unrolled loop, unroll=False for a runtime loop) and launch 2 (the state write)
    "conv1d_varlen": MappingProxyType({"block_t": 16, "block_d": 512, "num_warps": 4,
                                       "lookahead": 4, "unroll": True, "state_block_d": 256,
                                       "state_num_warps": 4}),
    # decode SSM step: None = block_p max(1, min(pow2(P), 4096 // pow2(N), 16)); num_warps 4 when
    # block_p * pow2(N) >= 2048, else 2
    "selective_state_update": MappingProxyType({"block_p": None, "num_warps": None}),
    # SSD chunked scan, per launch (0: dt, S: state passing, CB, C: scan); block sizes are powers
    # of two >= 16; the split rules below were timed at the 9B's head_dim 80 in bf16
    # (docs/kernels.md, run 19) and apply to 16-bit inputs (float32 keeps the one-tile layouts:
    # no second tile, no prefetch, one launch-C tile; the split launches spill heavily with
    # float32 operands).
    # None: block_h_dt min(32, pow2(H)); block_k_cb, block_n_scan min(128, max(16, pow2(N)));
    # block_l_state L; block_cb and block_m_scan min(L, 64).
    # Launch S: block_p2_state None = ssd._second_rows (80 past 64 rows: a second tile of 16 in
    # the same program, not a second program; 0 for a power-of-two head_dim); with a second tile
    # block_n_state None = 64 and prefetch_state None = True (the next chunk's tiles loaded before
    # this chunk's dot; contiguous chunks with block_l_state = L only), else block_n_state
    # min(128, max(16, pow2(N))) and no prefetch.
    # Launch C: block_p_scan and block_p2_scan both None = ssd._split_p (one tile of
    # min(128, max(16, pow2(P))), or where it pads less two tiles of one program, 80 -> 64 + 16);
    # one of them set: block_p_scan as set or that one tile, block_p2_scan as set or 0;
    # block_k_scan None = min(32, L) with two tiles, else 16.
    # block_p2_state / block_p2_scan > 0: a second tile of that many rows / columns in the same
    # program, past the first (the two must reach P); 0: none.
    "ssd": MappingProxyType({
        "block_h_dt": None, "num_warps_dt": 4,
        "block_p_state": 64, "block_p2_state": None, "block_n_state": None, "block_l_state": None,
        "num_warps_state": 4, "num_stages_state": 1, "prefetch_state": None,
        "block_cb": None, "block_k_cb": None, "num_warps_cb": 4,
        "block_m_scan": None, "block_p_scan": None, "block_p2_scan": None, "block_k_scan": None,
        "block_n_scan": None,
        "num_warps_scan": 4, "num_stages_scan": 3,
    }),
    # per-token paged attention (decode tokens): None = block_n max(16, min(64, 4096 // BLOCK_D));
    # num_warps 4 when BLOCK_D * BLOCK_N >= 4096, else 2; num_splits from the split-KV heuristic
    # (choose_num_splits with min_split_keys), an int forces that many key partitions
    "paged_attention": MappingProxyType({"block_n": None, "num_warps": None, "num_splits": None,
                                         "min_split_keys": 64}),
    # tiled paged attention (prefill tokens): block_m query rows per program; block_n None =
    # TILED_BLOCK_N (64 keys whatever the page size); num_warps None = `tiled_num_warps` (8
    # where 4 would spill the accumulator: 128 x 128 tiles); num_splits None = key partitions
    # from tiled_num_splits (few programs only) with min_split_keys, an int forces that many
    "paged_attention_tiled": MappingProxyType({"block_m": 128, "block_n": None, "num_warps": None,
                                               "num_splits": None, "min_split_keys": 256}),
    # rotary: None = block_h min(16, pow2(heads))
    "rotary": MappingProxyType({"block_h": None}),
    # decode snapshot copy: elements of a slot per program
    "state_copy": MappingProxyType({"block": 4096, "num_warps": 4}),
    # prefill conv snapshots: channels of one snapshot entry per program; not swept
    "conv_snapshot": MappingProxyType({"block_d": 256, "num_warps": 4}),
    # sparse MoE experts: block_m rows of one expert per block (None = 16 / 32 / 64 / 128 from
    # the mean pairs per expert); column tiles, K steps, warps and stages of the in (x w_in^T,
    # activation) and out (inter w_out^T, weight) GEMMs, and TMA loads; None = the rules of
    # `launch_params` (small blocks: decode; blocks of >= 64 rows: prefill); the k-sum (+ shared
    # expert) launch: combine_block elements of combine_block_h columns per program; not swept
    "moe_experts": MappingProxyType({
        "block_m": None, "block_n_in": None, "block_k_in": None, "num_warps_in": None,
        "num_stages_in": 3, "block_n_out": None, "block_k_out": None, "num_warps_out": None,
        "num_stages_out": None, "tma": None, "combine_block": 4096, "combine_block_h": 1024,
        "combine_num_warps": 4}),
    # MoE routing (ops/triton/moe_routing.py): one program per token; not swept
    "moe_routing": MappingProxyType({"num_warps": 1}),
    # linear of few rows (ops/triton/gemv.py): the dispatch routes at most max_m token rows of
    # bf16 / fp16 decode projections to it; None = the launcher's rules (`launch_plan`);
    # prefetch_bytes: under PDL the CUDA-core launch's programs ask L2 for that many bytes of
    # each weight row before the wait, off here
    # (bf16 batch-1 decode 0.09 ms slower with 2,048 on an H100: docs/kernels.md);
    # late_trigger: under PDL the next kernel is let in after the main loop, not at the start,
    # so its waiting programs do not take the slots of this launch's later waves (above all
    # the down projection's behind up with relu² in its epilogue; on an H100 batch-8 decode
    # ~1 % faster, batch 1 unchanged: docs/kernels.md)
    "gemv": MappingProxyType({"max_m": 8, "use_dot": None, "block_n": None, "block_k": None,
                              "split_k": None, "num_warps": 4, "num_stages": 4,
                              "prefetch_bytes": 0, "late_trigger": True}),
    # FP8 linear of few rows (ops/triton/fp8_gemv.py): the dispatch routes at most max_m token
    # rows to it (unless MAMBASERVE_FP8_GEMV=0); tensor cores from dot_min_m rows,
    # CUDA-core FMAs below; None = the launcher's rules (`launch_plan`); prequant: dynamic
    # activation scales by a separate quantization launch (`ops/fp8_matmul.py`)
    # FP8 activation quantization (ops/triton/fp8_quant.py): rows up to max_tile elements in one
    # register tile, wider ones in two passes; num_warps None = min(32, max(4, tile // 512))
    "fp8_quant": MappingProxyType({"max_tile": 16384, "num_warps": None}),
    # fold: with FMAs, that many neighbouring products along K summed before the accumulator;
    # promote_k: with tensor cores, the K elements one float8 MMA chain sums before its sum is
    # added to the float32 accumulator (0: every product exact, the operands upcast to fp16 MMAs;
    # 32: native fp8 wgmma instructions, each promoted: docs/kernels.md, "FP8 linear")
    # split_waves: the programs per SM below which the rules split K (None: by the inner product)
    # prefetch_bytes: as "gemv"'s, for the CUDA-core launch (below dot_min_m rows):
    # FP8 batch-1 decode 4.04-4.05 -> 4.00 ms with 2,048 on an H100 (docs/kernels.md)
    "fp8_gemv": MappingProxyType({"max_m": 32, "dot_min_m": 4, "block_n": None, "block_k": None,
                                  "split_k": None, "split_waves": None, "num_warps": 4,
                                  "num_stages": None,
                                  "prequant": True, "fold": 1, "promote_k": 0,
                                  "prefetch_bytes": 2048}),
})

# No other device has been tuned: the sm_90 values serve everywhere else.
DEFAULT = SM90
BY_CAPABILITY: Mapping[tuple[int, int], Mapping[str, Mapping[str, object]]] = MappingProxyType(
    {(9, 0): SM90})

_overrides: contextvars.ContextVar[tuple[tuple[str, Mapping[str, object]], ...]] = (
    contextvars.ContextVar("mambaserve_triton_tuning_overrides", default=()))


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def table_for(device) -> Mapping[str, Mapping[str, object]]:
    """The table entry of `device` (a torch.device or a string): its compute capability's, else
    DEFAULT. A host query, cached per device: no sync, capturable in a CUDA graph."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return BY_CAPABILITY.get(_cuda_capability(idx), DEFAULT)


# knob values for the whole process: "kernel.knob=value,..." (module docstring)
TUNING_ENV = "MAMBASERVE_TUNING"


@functools.cache
def env_values() -> Mapping[str, Mapping[str, object]]:
    """MAMBASERVE_TUNING's knob values by kernel, read once per process (`cache_clear()` reads
    it again); ValueError (one line, naming the entry) for an entry that is not
    `kernel.knob=literal` of a known kernel and knob."""
    return parse_tuning(os.environ.get(TUNING_ENV, ""))


def parse_tuning(text: str) -> Mapping[str, Mapping[str, object]]:
    """The knob values of a MAMBASERVE_TUNING string, by kernel (`env_values`)."""
    out: dict[str, dict[str, object]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        kernel, dot, knob = name.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"{TUNING_ENV}: {item!r} is not kernel.knob=value")
        if kernel not in DEFAULT:
            raise ValueError(f"{TUNING_ENV}: no tuning entry {kernel!r}; known: {sorted(DEFAULT)}")
        if knob not in DEFAULT[kernel]:
            raise ValueError(f"{TUNING_ENV}: kernel {kernel!r} has no knob {knob!r}; its knobs: "
                             f"{sorted(DEFAULT[kernel])}")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{TUNING_ENV}: {item!r}: the value is not a Python literal "
                             "(a number, True, False or None)") from None
        out.setdefault(kernel, {})[knob] = value
    return MappingProxyType({k: MappingProxyType(v) for k, v in out.items()})


def config(kernel: str, device) -> Mapping[str, object]:
    """The knobs of `kernel` on `device` (read-only): the device's table entry, then the values
    of MAMBASERVE_TUNING, then the active overrides on top."""
    entry = table_for(device).get(kernel)
    if entry is None:
        raise KeyError(f"no tuning entry for kernel {kernel!r}; known: {sorted(DEFAULT)}")
    from_env = env_values().get(kernel)
    active = [values for name, values in _overrides.get() if name == kernel]
    if not active and not from_env:
        return entry
    knobs = dict(entry)
    for values in ([from_env] if from_env else []) + active:
        knobs.update(values)
    return MappingProxyType(knobs)


@contextlib.contextmanager
def override(kernel: str, **knobs: object) -> Iterator[None]:
    """Within the block, launches of `kernel` use these knob values on every device."""
    known = DEFAULT.get(kernel)
    if known is None:
        raise KeyError(f"no tuning entry for kernel {kernel!r}; known: {sorted(DEFAULT)}")
    unknown = sorted(set(knobs) - set(known))
    if unknown:
        raise TypeError(f"kernel {kernel!r} has no knob(s) {unknown}; its knobs: {sorted(known)}")
    token = _overrides.set(_overrides.get() + ((kernel, MappingProxyType(dict(knobs))),))
    try:
        yield
    finally:
        _overrides.reset(token)


__all__ = ["BY_CAPABILITY", "DEFAULT", "SM90", "TUNING_ENV", "config", "env_values", "override",
           "parse_tuning", "table_for"]
