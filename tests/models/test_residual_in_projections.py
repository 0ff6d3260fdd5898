"""The residual stream added by each block's closing projection (out_proj, o_proj, down, Falcon-H1's
packed mixer output) in steps of more rows than the few-rows kernel takes
(`ops.linear.residual_in_projections`), instead of by the next norm's pass: taken in every family
where that projection is plain, and the same logits as the add in the norm (the reference path)
and as transformers."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import MAKERS, hf_prompt_logprobs, load_hf

import mambaserve.layers.linear as layer_linear
import mambaserve.models.hybrid as hybrid
import mambaserve.models.nemotron_h as nemotron_h
from mambaserve import LLM, SamplingParams

CASES = [  # (architecture, maker overrides)
    ("NemotronH", {}),  # Mamba, attention, relu² MLP and MoE blocks (the shared expert's down)
    ("FalconH1ForCausalLM", {}),  # both mixers in one packed output projection, SwiGLU
    ("GraniteMoeHybridForCausalLM", {"num_local_experts": 0}),  # dense: shared SwiGLU MLP
    ("GraniteMoeHybridForCausalLM", {}),  # SwiGLU experts beside the shared expert
    ("Mamba2ForCausalLM", {}),  # Mamba only, residual in float32 (a float32 model here)
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + ("-dense" if c[1] else ""))
def checkpoint(request, tmp_path_factory, tiny_ckpt):
    arch, overrides = request.param
    if arch == "NemotronH":
        return tiny_ckpt, load_hf(tiny_ckpt)
    path = MAKERS[arch](tmp_path_factory.mktemp(arch) / "ckpt", seed=5, **overrides)
    return path, load_hf(path)


def _prompt_logprobs(path, ids):
    llm = LLM(path, max_num_seqs=1, device="cpu")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True))[0]
    return torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def test_closing_projections_add_the_residual(checkpoint, monkeypatch):
    path, hf = checkpoint
    ids = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = []
    real = layer_linear.linear_residual

    def spy(x, weight, residual):
        calls.append(x.shape[0])
        return real(x, weight, residual)

    monkeypatch.setattr(layer_linear, "linear_residual", spy)
    folded = _prompt_logprobs(path, ids)
    assert calls and set(calls) == {len(ids)}  # the prompt's step only, every time
    torch.testing.assert_close(folded, hf_prompt_logprobs(hf, ids), rtol=0, atol=1e-4)

    calls.clear()
    for module in (hybrid, nemotron_h):
        monkeypatch.setattr(module, "residual_in_projections", lambda rows, device: False)
    in_norm = _prompt_logprobs(path, ids)
    assert not calls
    torch.testing.assert_close(folded, in_norm, rtol=0, atol=2e-5)
