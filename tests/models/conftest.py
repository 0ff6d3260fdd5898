"""Fixtures of the model tests that run a model's forward directly: `family_engine`, a CPU engine
over each family's tiny checkpoint (NemotronH also with FP8 projections), and `random_pools`, its
state and KV pools filled with random values (and a copy of them, to start another forward
from)."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import MAKERS

from mambaserve import LLM

PAGE_SIZE = 4
FAMILY_CASES = [("NemotronH", {}), ("NemotronH", {"quantization": "fp8"}),
                ("FalconH1ForCausalLM", {}), ("GraniteMoeHybridForCausalLM", {}),
                ("BambaForCausalLM", {}), ("Mamba2ForCausalLM", {})]


@pytest.fixture(scope="module", params=FAMILY_CASES,
                ids=lambda c: c[0] + ("-fp8" if c[1] else ""))
def family_engine(request, tmp_path_factory, tiny_ckpt):
    arch, kw = request.param
    path = tiny_ckpt if arch == "NemotronH" else MAKERS[arch](
        tmp_path_factory.mktemp(arch) / "ckpt", seed=2)
    return LLM(path, device="cpu", max_model_len=64, max_num_seqs=4, page_size=PAGE_SIZE,
               **kw).engine


@pytest.fixture
def random_pools(family_engine):
    sp, kv = family_engine.state_pool, family_engine.kv_pool
    pools = (sp.conv_state, sp.ssm_state, kv.kv_cache)
    g = torch.Generator().manual_seed(5)
    for t in pools:
        t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return pools, [t.clone() for t in pools]
