"""`mambaserve bench kernels --dry`: the kernel benchmark's CPU smoke run (tiny shapes under the
Triton interpreter) through the CLI, on its two cheapest cases; and the peer loader's rewrite of
vLLM's imports."""

from __future__ import annotations

import json

import pytest
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.bench.kernels_peers import _replace_vllm_imports, load_vllm_conv
from mambaserve.cli import main
from mambaserve.ops.triton.activation import _relu2_kernel

require_interpreter(_relu2_kernel)


@pytest.mark.skipif(DEV != "cpu", reason="the dry run is the CPU smoke test")
def test_dry_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    missing_peer = tmp_path / "absent.py"
    assert main(["bench", "kernels", "--dry", "--only", "decode,norm", "--out", str(out),
                 "--conv-peer", str(missing_peer)]) == 0
    res = json.loads(out.read_text())
    assert res["env"]["gpu"] == "cpu (dry run)" and res["conv_peer"] is False
    got = {(r["op"], r["impl"], r.get("batch", r.get("tokens"))) for r in res["rows"]}
    for op in ("ssu", "conv_update"):
        for impl in ("triton", "torch ref"):
            assert {(op, impl, 1), (op, impl, 3)} <= got
    assert {("gated_rmsnorm", "triton", 3), ("gated_rmsnorm", "torch ref", 3)} <= got
    # our kernels against the references on the timed inputs (fp16 on the CPU)
    errs = [r["rel_err"] for r in res["rows"] if r["impl"] == "triton"]
    assert len(errs) == 5 and all(e < 1e-2 for e in errs), errs
    printed = capsys.readouterr().out
    assert "conv peer not available" in printed and "| ssu | triton | 3 |" in printed


@pytest.mark.skipif(DEV != "cpu", reason="the dry run is the CPU smoke test")
def test_dry_norm_sweep(tmp_path):
    """--sweep times the gated norm at each NORM_SWEEP warp count too, each against the
    reference."""
    from mambaserve.bench.kernels_decode import NORM_SWEEP

    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--dry", "--only", "norm", "--sweep", "--out",
                 str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["op"] == "gated_rmsnorm"]
    swept = {r["impl"]: r["rel_err"] for r in rows if r["impl"].startswith("triton")}
    assert set(swept) == {"triton"} | {f"triton w{nw}" for nw in NORM_SWEEP}
    assert all(e < 1e-2 for e in swept.values()), swept


@pytest.mark.skipif(DEV != "cpu", reason="the dry run is the CPU smoke test")
def test_dry_moe_case(tmp_path):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--dry", "--only", "moe", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["op"], r["impl"], r["tokens"]) for r in rows}
    for op in ("moe dry-relu2", "moe dry-swiglu"):
        for impl in ("triton", "torch loop", "dense ref"):
            assert {(op, impl, 1), (op, impl, 20)} <= got
    for op in ("moe routing dry-relu2", "moe routing dry-swiglu"):
        for impl in ("triton", "torch"):
            assert {(op, impl, 1), (op, impl, 20)} <= got
    errs = [r["rel_err"] for r in rows if r["impl"] == "triton" and "rel_err" in r]
    assert len(errs) == 4 and all(e < 1e-2 for e in errs), errs


def test_unknown_case_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown case"):
        from mambaserve.bench.kernels import run

        run(["decode", "mlp"], False, str(tmp_path / "k.json"), True, None)


def test_vllm_imports_replaced_line_for_line(tmp_path):
    src = ("import torch\n"
           "from vllm.triton_utils import tl, triton\n"
           "    from vllm.attention.backends.utils import PAD_SLOT_ID\n"
           "x = 1\n")
    out = _replace_vllm_imports(src).splitlines()
    assert out == ["import torch", "import triton.language as tl; import triton",
                   "    PAD_SLOT_ID = -1", "x = 1"]
    with pytest.raises(ImportError, match="no stand-in"):
        _replace_vllm_imports("from vllm.platforms import current_platform\n")
    with pytest.raises(ImportError, match="unsupported"):
        _replace_vllm_imports("import vllm.envs as envs\n")
    bad = tmp_path / "causal_conv1d.py"
    bad.write_text("from vllm.platforms import current_platform\n")
    assert load_vllm_conv(bad) is None  # reported, not raised


def test_ssd_sweep_variants_resolve_at_the_9b_shapes():
    """Every launch-parameter variant `bench kernels --only prefill --sweep` times for the SSD
    scan names real knobs and passes the launcher's checks at the 9B layer shapes (head_dim 80),
    and the split variants each undo one of the defaults' choices."""
    import torch

    from mambaserve.bench.kernels_prefill import SSD_SCAN_SWEEP, SSD_SPLIT_SWEEP, SSD_STATE_SWEEP
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata
    from mambaserve.ops.triton import tuning
    from mambaserve.ops.triton.ssd import SsdScan

    H, P, N, G, L, T = 128, 80, 128, 8, 128, 40
    meta = build_metadata(Batch(prefills=[Row.standalone([1] * T, 0, 0, False, [0])],
                                decodes=[]), chunk_size=L, conv_kernel=4, page_size=1 << 20,
                          scratch_page=0, device="cpu")
    pm = meta.prefill
    bf = torch.bfloat16

    def resolve(dtype=bf, **knobs):
        x, B = torch.zeros(T, H, P, dtype=dtype), torch.zeros(T, G, N, dtype=dtype)
        with tuning.override("ssd", **knobs):
            s = SsdScan(x, torch.zeros(T, H, dtype=dtype), -torch.ones(H), B, B, torch.zeros(H),
                        torch.zeros(H), (0.0, float("inf")), torch.zeros(2, H, P, N),
                        pm.state_slots.to(torch.int32), pm.has_initial_state, pm.chunk_token_idx,
                        pm.token_chunk_pos, pm.row_chunks, pm.row_num_chunks)
        return s.bps2, s.bns, s.prefetch_state, s.bpc2, s.bk

    assert resolve() == (16, 64, True, 16, 32)  # the defaults at head_dim 80 in bf16
    assert resolve(torch.float32) == (0, 128, False, 0, 16)  # float32: the one-tile layouts
    for bp, bn, nw, *rest in SSD_STATE_SWEEP:
        bl, ns = rest or (None, 1)
        got = resolve(block_p_state=bp, block_n_state=bn, num_warps_state=nw, block_l_state=bl,
                      num_stages_state=ns, block_p2_state=0, prefetch_state=False)
        assert got[:3] == (0, bn, False)
    for bm, bp, bk, nw, ns in SSD_SCAN_SWEEP:
        assert resolve(block_m_scan=bm, block_p_scan=bp, block_k_scan=bk, num_warps_scan=nw,
                       num_stages_scan=ns)[3:] == (0, bk)
    undone = {name: resolve(**knobs) for name, knobs in SSD_SPLIT_SWEEP}
    assert undone["state second program"][:3] == (0, 128, False)
    assert undone["state split no prefetch"][:3] == (16, 64, False)
    assert undone["scan one P tile"][3:] == (0, 16)
    assert undone["scan split k16"][3:] == (16, 16)


def test_table_shows_a_graph_timed_row(capsys):
    """The SSD's "cold L2" row carries only `device_us` (CUDA graphs): the table prints it
    instead of failing on the missing host time (which lost the whole table on a GPU)."""
    from mambaserve.bench.kernels import print_table

    print_table([
        {"op": "ssd_scan", "impl": "triton", "shape": "1x2048", "us": 167.5, "TFLOPs": 147.5,
         "rel_err": 2.7e-3, "device_us": 156.6},
        {"op": "ssd_scan", "impl": "triton, cold L2", "shape": "1x2048", "copies": 3,
         "TFLOPs": 154.7, "device_us": 159.6},
    ])
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("| ssd_scan | triton | 1x2048 | 167.5 | 147.5 TFLOP/s | 2.7e-03")
    assert out[-1].startswith("| ssd_scan | triton, cold L2 | 1x2048 | 159.6 (graph) | 154.7")
