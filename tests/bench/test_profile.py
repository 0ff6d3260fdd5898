"""`mambaserve bench profile` on the CPU (tiny preset): both phases profiled, kernel groups."""

from __future__ import annotations

import json

import pytest

from mambaserve.bench.one_batch import OneBatchConfig
from mambaserve.bench.profile import (
    PHASE_MARK,
    format_phase,
    group_of,
    profile_batch,
    trace_idle,
    trace_kernel_times,
)
from mambaserve.cli import main


@pytest.mark.parametrize("name, group", [
    ("_chunk_scan_kernel", "ssd"), ("_chunk_state_passing_kernel", "ssd"),
    ("_conv_varlen_kernel", "conv"), ("_ssu_kernel", "state_update"),
    ("_paged_attention_kernel", "attention"), ("_write_kv_kernel", "attention"),
    ("_gated_rmsnorm_kernel", "norm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("aten::mm", "matmul"),
    ("_gemv_kernel", "matmul"), ("_fp8_gemv_kernel", "matmul"), ("_silu_mul_kernel", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu>", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("c10d::allreduce_", "communication"),
    ("some_unknown_kernel", "other"),
])
def test_group_of_real_kernel_names(name, group):
    assert group_of(name) == group


def test_profile_tiny_on_cpu():
    logs = []
    pre, dec = profile_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[24],
                                            dtype="float32"), decode_steps=3, top=5,
                             log=logs.append)
    assert (pre.phase, pre.steps, dec.phase, dec.steps) == ("prefill", 1, "decode", 3)
    for p in (pre, dec):
        assert p.wall_s > 0 and p.device_busy_s > 0
        # on the CPU the busy time is the operators' summed self time, every group included
        assert sum(p.groups.values()) == pytest.approx(p.device_busy_s)
        assert p.groups["matmul"] > 0 and len(p.top) == 5
        assert [t[1] for t in p.top] == sorted((t[1] for t in p.top), reverse=True)
        assert any(g in format_phase(p) for g in p.groups)
    assert pre.matmul_flops > 0 and "TFLOP/s" in pre.notes[0]
    assert dec.matmul_bytes > 0 and "GB/s" in dec.notes[0]
    assert "prefill:" in logs[1] and "decode:" in logs[2]


def test_profile_mixed_phase_prefills_one_prompt_beside_the_decodes():
    """--mixed-len: one new prompt, capped at max_step_prefill_tokens per step while the batch
    decodes, takes ceil(M / cap) steps to its first token."""
    phases = profile_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[16],
                                          dtype="float32",
                                          engine={"max_step_prefill_tokens": 8}),
                           decode_steps=2, top=3, log=lambda *_: None, mixed_len=20)
    assert [p.phase for p in phases] == ["prefill", "decode", "mixed"]
    mixed = phases[2]
    assert mixed.steps == 3 and "20-token prompt" in mixed.notes[0]
    assert mixed.groups["matmul"] > 0


def test_profile_follow_up_turn_hits_the_prefix_cache():
    """--cached-prefix-len: the profiled prefill is the suffix after a cached history; the note
    says what the cache served (the whole history, in chunk-aligned blocks)."""
    logs = []
    pre, _ = profile_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[8],
                                          dtype="float32", cached_prefix_len=32),
                           decode_steps=2, top=3, log=logs.append)
    assert pre.steps == 1
    assert any("after a 32-token history: the prefix cache served 32..32 tokens" in note
               for note in pre.notes)
    # the suffix's matmul work: its own tokens only (the history is not recounted)
    solo, _ = profile_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[8],
                                           dtype="float32"), decode_steps=2, top=3,
                            log=lambda *_: None)
    assert pre.matmul_flops == solo.matmul_flops


def test_profile_cli_writes_json_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "profile", "--preset", "tiny", "--dtype", "float32", "--batch-size",
                 "1", "--input-len", "8", "--steps", "2", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())
    assert [p["phase"] for p in phases] == ["prefill", "decode"]
    assert main(["bench", "profile", "--preset", "tiny", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_trace_kernel_times_by_name_and_by_grid():
    """A CUDA trace's kernels summed per name, or per name and launch grid; the busy time is
    the union of the device intervals (overlaps counted once); host events are ignored."""
    def k(name, ts, dur, grid, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"grid": grid}}

    events = [k("_gemv_kernel", 0, 10, [2832, 1, 1]), k("_gemv_kernel", 10, 6, [560, 1, 1]),
              k("_gemv_kernel", 20, 10, [2832, 1, 1]), k("_rms_norm_kernel", 25, 10, [1, 1, 1]),
              {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 40, "dur": 2},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    times, busy = trace_kernel_times(events)
    assert times == {"_gemv_kernel": [pytest.approx(26e-6), 3],
                     "_rms_norm_kernel": [pytest.approx(10e-6), 1],
                     "Memcpy DtoH": [pytest.approx(2e-6), 1]}
    assert busy == pytest.approx(33e-6)  # [0, 16] + [20, 35] + [40, 42]
    times, busy_grid = trace_kernel_times(events, by_grid=True)
    assert times["_gemv_kernel grid 2832x1x1"] == [pytest.approx(20e-6), 2]
    assert times["_gemv_kernel grid 560x1x1"] == [pytest.approx(6e-6), 1]
    assert "Memcpy DtoH" in times and busy_grid == busy
    assert group_of("_gemv_kernel grid 2832x1x1") == "matmul"


def test_trace_idle_splits_the_waits_before_between_and_after_the_kernels():
    """The host range of the phase [100, 200] µs, kernels in [110, 130], [125, 140] (overlap:
    no gap), [150, 160], [190, 195]: 10 µs before the first, 5 after the last, gaps of 10 and
    30 between, the largest first with the kernels around it; a gpu_user_annotation of the same
    name (the device's copy of the range) is not the host range."""
    def k(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [{"cat": "gpu_user_annotation", "name": PHASE_MARK, "ts": 0, "dur": 500},
              {"cat": "user_annotation", "name": PHASE_MARK, "ts": 100, "dur": 100},
              k("a", 110, 20), k("b", 125, 15), k("c", 150, 10),
              {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 190, "dur": 5}]
    idle = trace_idle(events)
    assert idle["before_first_s"] == pytest.approx(10e-6)
    assert idle["after_last_s"] == pytest.approx(5e-6)
    assert idle["between_s"] == pytest.approx(40e-6) and idle["gaps"] == 2
    first, second = idle["largest"]
    assert first == {"s": pytest.approx(30e-6), "at_s": pytest.approx(60e-6), "after": "c",
                     "before": "Memcpy DtoH"}
    assert second["after"] == "b" and second["before"] == "c"
    assert second["s"] == pytest.approx(10e-6)
    assert trace_idle(events[2:]) == {}  # no host range
    assert trace_idle(events[:2]) == {}  # no device events
