"""The two MoE routers' last stage: from each token's router logits to its k experts and their
weights, in one op per router kind.

    ids, weights = softmax_topk(logits, k, dtype)
    ids, weights = sigmoid_topk(logits, bias, k, normalize, scale)

- `softmax_topk` (GraniteMoeHybrid, transformers' GraniteMoeHybridTopKRouter): the k largest of
  logits [T, E] (any float dtype, compared in float32), weights = softmax over those k values in
  float32, cast to `dtype`. ids [T, k] int64 in descending order of the logits.
- `sigmoid_topk` (NemotronH without group selection, transformers' NemotronHTopkRouter with every
  group kept): scores = sigmoid(logits) (float32 [T, E]), the k largest of scores + bias (the
  e_score_correction_bias, [E]), weights = their scores, divided by their sum + 1e-20 when
  `normalize`, times `scale`; float32.

Ties go to the lowest expert index on the kernel path; torch's topk leaves their order open.

The references are the routers' torch math (a topk, a softmax or a gather, the casts: five to
ten launches per layer); on CUDA one Triton launch does each (`ops/triton/moe_routing.py`): a
program per token finds its k largest by k rounds of a row maximum. Exponentials are CUDA's
expf (libdevice) and divisions IEEE, as torch computes them; the sums of the k weights may
differ from torch's in their order, so weights may differ by an ulp.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path


def softmax_topk(logits: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """(ids [T, k] int64, weights [T, k] in `dtype`); see the module docstring."""
    _check(logits, k)
    if kernel_path("moe_routing", logits.device) == "triton":
        from mambaserve.ops.triton.moe_routing import route_topk_triton

        return route_topk_triton(logits, k, dtype)
    return softmax_topk_ref(logits, k, dtype)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, weights [T, k] float32); see the module docstring."""
    _check(logits, k)
    if logits.dtype != torch.float32 or bias.shape != (logits.shape[1],):
        raise ValueError(f"sigmoid_topk takes float32 logits [T, E] and a bias [E]; got "
                         f"{logits.dtype} {tuple(logits.shape)} and {tuple(bias.shape)}")
    if kernel_path("moe_routing", logits.device) == "triton":
        from mambaserve.ops.triton.moe_routing import route_topk_triton

        return route_topk_triton(logits, k, torch.float32, bias=bias, normalize=normalize,
                                 scale=scale)
    return sigmoid_topk_ref(logits, bias, k, normalize, scale)


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route {k} of {logits.shape[-1]} experts from logits of shape "
                         f"{tuple(logits.shape)}: want [tokens, experts] and 1 <= k <= experts")


def softmax_topk_ref(logits: torch.Tensor, k: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    top_v, top_i = logits.float().topk(k, dim=-1)
    return top_i, torch.softmax(top_v, dim=-1).to(dtype)


def sigmoid_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits)
    top_i = torch.topk(scores + bias, k=k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if normalize:
        top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
    return top_i, top_w * scale
