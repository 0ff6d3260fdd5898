"""The decoders with the few-rows launches (`ops.linear`: every projection, the MLP activation
applied by its down projection's launch, Falcon-H1's Mamba output added by o_proj's launch) taken
wherever a step has at most 8 rows, as on a GPU: here forced on the CPU, the kernels on Triton's
interpreter in float32. Prompt logprobs in chunks of 5 tokens (every chunk on the kernels) and
greedy decoding against transformers, at the same tolerance as the reference path."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))
from triton_env import require_interpreter  # noqa: E402  (before anything imports triton)

# isort: split
from family_checkpoints import MAKERS, hf_greedy, hf_prompt_logprobs, load_hf  # noqa: E402

import mambaserve.ops.linear as linear_ops  # noqa: E402
from mambaserve import LLM, SamplingParams  # noqa: E402
from mambaserve.ops.triton.gemv import _gemv_kernel  # noqa: E402

require_interpreter(_gemv_kernel)


@pytest.fixture
def forced_kernels(monkeypatch):
    """Route the few-rows ops of at most 8 rows to their kernel on the CPU (float32 included);
    returns the count of kernel launches per op."""
    real = linear_ops.kernel_path
    launches = {"act_linear": 0, "gemv": 0}

    def kernel_path(op, device, **inputs):
        if op not in launches:
            return real(op, device, **inputs)
        if math.prod(inputs["x"].shape[:-1]) <= 8:
            launches[op] += 1
            return "triton"
        return "reference"

    monkeypatch.setattr(linear_ops, "kernel_path", kernel_path)
    return launches


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = [  # (architecture, maker overrides, has an MLP)
    ("NemotronH", {}, True),  # Mamba, attention, relu² MLP and MoE blocks
    ("FalconH1ForCausalLM", {}, True),  # both mixers (o_proj adds Mamba's output), SwiGLU
    ("GraniteMoeHybridForCausalLM", {"num_local_experts": 0}, True),  # dense: shared SwiGLU MLP
    ("Mamba2ForCausalLM", {}, False),  # Mamba only, residual in float32
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def checkpoint(request, tmp_path_factory, tiny_ckpt):
    arch, overrides, has_mlp = request.param
    if arch == "NemotronH":
        return tiny_ckpt, load_hf(tiny_ckpt), has_mlp
    path = MAKERS[arch](tmp_path_factory.mktemp(arch) / "ckpt", seed=4, **overrides)
    return path, load_hf(path), has_mlp


def test_fused_launches_match_hf(checkpoint, forced_kernels):
    path, hf, has_mlp = checkpoint
    ids = _ids(23, 7)
    llm = LLM(path, chunked_prefill_size=5, max_num_seqs=2, device="cpu")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=6, prompt_logprobs=0, temperature=0,
                                      ignore_eos=True))[0]
    got = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
    torch.testing.assert_close(got, hf_prompt_logprobs(hf, ids), rtol=0, atol=1e-4)
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 6)
    assert forced_kernels["gemv"] > 0
    assert (forced_kernels["act_linear"] > 0) == has_mlp
