"""The optional peer kernels of `mambaserve bench kernels`, loaded when present (never
committed, never required; without them the benchmark times ours and the references only):

* mamba_ssm's Triton kernels (selective_state_update, mamba_chunk_scan_combined, rmsnorm_fn),
  imported from sys.path: mamba-ssm 2.3.2.post1's source unpacked under the git-ignored `.peer/`
  (top-level `__init__.py` emptied) and put on PYTHONPATH;
* vLLM's pure-Triton causal conv1d (`causal_conv1d_fn` for the varlen prefill,
  `causal_conv1d_update` for decode; mamba_ssm has no Triton conv), read from
  `.peer/vllm_conv/causal_conv1d.py` (vllm-project/vllm,
  vllm/model_executor/layers/mamba/ops/causal_conv1d.py, unmodified) with its `vllm.*` imports
  replaced at load time.
"""

from __future__ import annotations

import linecache
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
CONV_PEER_FILE = REPO_ROOT / ".peer" / "vllm_conv" / "causal_conv1d.py"

# what the vLLM file's `from vllm... import NAME` lines provide, as plain code
_VLLM_NAMES = {"tl": "import triton.language as tl", "triton": "import triton",
               "PAD_SLOT_ID": "PAD_SLOT_ID = -1"}


def load_mamba_ssm() -> dict | None:
    """mamba_ssm's decode step, chunked scan and gated norm, or None (with a printed reason)."""
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001  (any failure means: no peer)
        print(f"peer mamba_ssm not available ({type(e).__name__}: {e}); timing ours and the "
              "reference only", flush=True)
        return None
    return {"ssu": selective_state_update, "scan": mamba_chunk_scan_combined, "norm": rmsnorm_fn}


def _replace_vllm_imports(src: str) -> str:
    """The module text with each `from vllm... import A, B` line replaced by the stand-ins of
    A and B on the same line (line numbers stay those of the file)."""
    out = []
    for line in src.splitlines():
        m = re.match(r"\s*from\s+vllm[\w.]*\s+import\s+\(?([\w\s,]+)\)?\s*$", line)
        if m:
            names = [n.strip() for n in m.group(1).split(",") if n.strip()]
            missing = [n for n in names if n not in _VLLM_NAMES]
            if missing:
                raise ImportError(f"no stand-in for vllm names {missing} ({line.strip()!r})")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + "; ".join(_VLLM_NAMES[n] for n in names))
        elif re.match(r"\s*(import|from)\s+vllm\b", line):
            raise ImportError(f"unsupported vllm import {line.strip()!r}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def load_vllm_conv(path: str | os.PathLike = CONV_PEER_FILE) -> SimpleNamespace | None:
    """vLLM's Triton causal conv1d as a namespace (`fn`: causal_conv1d_fn, `update`:
    causal_conv1d_update), or None (with a printed reason) when the file is absent or does not
    load."""
    path = Path(path)
    if not path.exists():
        print(f"conv peer not available ({path} absent: save vllm-project/vllm's "
              "vllm/model_executor/layers/mamba/ops/causal_conv1d.py there); timing ours and the "
              "reference only", flush=True)
        return None
    try:
        text = _replace_vllm_imports(path.read_text())
        # triton.jit reads each kernel's source through inspect/linecache: register the text
        fname = f"{path.resolve()} (vllm imports replaced)"
        linecache.cache[fname] = (len(text), None, text.splitlines(True), fname)
        ns = {"__name__": "vllm_causal_conv1d_peer", "__file__": fname}
        exec(compile(text, fname, "exec"), ns)  # noqa: S102  (the peer's own module text)
        return SimpleNamespace(fn=ns["causal_conv1d_fn"], update=ns["causal_conv1d_update"])
    except Exception as e:  # noqa: BLE001
        print(f"conv peer did not load ({type(e).__name__}: {e}); timing ours and the reference "
              "only", flush=True)
        return None


def vllm_conv_metadata(seqlens: list[int], device) -> SimpleNamespace:
    """The `metadata` causal_conv1d_fn accepts: its per-program (row, segment) tables for the
    usual BLOCK_M values, built once on the host so the timed call does no host work (without
    it every call copies query_start_loc to the host)."""
    import numpy as np

    nums_dict = {}
    for bm in (4, 8, 16, 32, 64):
        nums = [-(-n // bm) for n in seqlens]
        mlist = np.repeat(np.arange(len(nums)), nums)
        offs = np.concatenate([np.arange(n) for n in nums]) if nums else np.zeros(0, np.int64)
        bp = torch.tensor(mlist, dtype=torch.int32, device=device)
        op = torch.tensor(offs, dtype=torch.int32, device=device)
        nums_dict[bm] = {"tot": int(sum(nums)), "mlist": bp, "mlist_len": len(mlist),
                         "offsetlist": op, "batch_ptr": bp, "token_chunk_offset_ptr": op}
    return SimpleNamespace(nums_dict=nums_dict, batch_ptr=nums_dict[8]["batch_ptr"],
                           token_chunk_offset_ptr=nums_dict[8]["token_chunk_offset_ptr"])
