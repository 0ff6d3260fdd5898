"""Fixtures of the model tests that run a model's forward directly: `family_engine`, a CPU engine
over each family's tiny checkpoint (NemotronH also with FP8 projections), and `random_pools`, its
state and KV pools filled with random values (and a copy of them, to start another forward
from)."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import MAKERS
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve import LLM

PAGE_SIZE = 4
# (id, architecture, engine options, NemotronH layers: None = the shared tiny checkpoint's, whose
# last token-mixing layer is attention)
FAMILY_CASES = [("NemotronH", "NemotronH", {}, None),
                ("NemotronH-fp8", "NemotronH", {"quantization": "fp8"}, None),
                # ends like the 9B: a Mamba layer, then an MLP
                ("NemotronH-mamba-last", "NemotronH", {},
                 ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]),
                *((arch, arch, {}, None) for arch in ("FalconH1ForCausalLM",
                                                     "GraniteMoeHybridForCausalLM",
                                                     "BambaForCausalLM", "Mamba2ForCausalLM"))]


@pytest.fixture(scope="module", params=FAMILY_CASES, ids=lambda c: c[0])
def family_engine(request, tmp_path_factory, tiny_ckpt):
    name, arch, kw, layers = request.param
    if arch != "NemotronH":
        path = MAKERS[arch](tmp_path_factory.mktemp(arch) / "ckpt", seed=2)
    elif layers is None:
        path = tiny_ckpt
    else:
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", seed=2,
                                    layers=layers)
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
