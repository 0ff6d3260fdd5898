"""Sync-free, batch-invariant token sampler.

Runs on the device after the model forward, once per engine step, for B rows (one per running
request). The token and its logprob come from one op (`ops/sample_rows.py`: one Triton launch
on CUDA); top-k / top-p / min-p run before it in torch. No host syncs, no data-dependent shapes, no
``torch.multinomial``: sampling is Gumbel-max (``argmax(logits / T + g)``) where the Gumbel
noise ``g`` is a pure function of ``(seed, step, token_id)`` computed by a counter-based 32-bit
integer hash (int64 torch ops; the same integer operations inside the kernel).
A row's sample therefore does not depend on the other rows or on its position in the batch.

Semantics follow vLLM: rows with ``temperature < 1e-5`` are greedy (argmax of the raw logits,
lowest index on ties, filters ignored). Otherwise: temperature scaling, then top-k, then top-p
(over the softmax of the scaled, top-k-filtered logits: keep the smallest descending prefix whose
cumulative probability is >= top_p), then min-p (drop tokens with probability < min_p * max
probability). Each filter is a per-row logit threshold, so ties at a boundary are all KEPT
(top-k may keep more than k tokens if several equal the k-th largest value). Reported logprobs are
those of the RAW logits (model distribution, before temperature and filters).

Before any of that, rows may have their logits processed (layers/logits_processors.py, each op
only when some row of the step uses it, by host flag): the structured-output token mask, then
logit_bias, then the repetition / frequency / presence penalties. Greedy rows take the argmax of
the processed logits too; reported logprobs stay those of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.host_upload import upload
from mambaserve.layers.logits_processors import (
    PenaltyBatch,
    apply_logit_bias,
    apply_token_bitmask,
)
from mambaserve.ops.sample_rows import GREEDY_EPS, row_logprobs, sample_rows


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step: device tensors and host flags."""

    temperature: torch.Tensor  # [B] float32; < 1e-5 (e.g. 0.0) means greedy for that row
    top_k: torch.Tensor  # [B] int32; <= 0 (or >= V) means disabled
    top_p: torch.Tensor  # [B] float32; >= 1.0 means disabled
    min_p: torch.Tensor  # [B] float32; <= 0.0 means disabled
    seed: torch.Tensor  # [B] int64; the request's seed
    step: torch.Tensor  # [B] int64; index of the token being sampled within the request
    num_logprobs: int  # host int: how many top alternatives to return (0 = none)
    all_greedy: bool  # host flag: every row is greedy (skip the random path)
    need_filters: bool  # host flag: some row uses top_k / top_p / min_p
    # logits processing (None: no row of the step uses it)
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32; all ones = no constraint
    bias_rows: torch.Tensor | None = None  # [N] int64: logit_bias entries (row, token, value)
    bias_tokens: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    penalties: PenaltyBatch | None = None  # per-request token counts on the device

    @property
    def processes_logits(self) -> bool:
        """Some row uses a logits processor (token mask, logit bias, penalties)."""
        return self.token_bitmask is not None or self.bias_rows is not None \
            or self.penalties is not None

    @staticmethod
    def host_arrays(temperature: list[float], top_k: list[int], top_p: list[float],
                    min_p: list[float], seed: list[int], step: list[int], *,
                    logit_bias: list[dict[int, float] | None] | None = None,
                    token_bitmask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The per-row parameters as host arrays, to upload with the step's other arrays.

        Seeds may be any Python int; they are reduced mod 2**64 and reinterpreted as int64.
        `logit_bias` (one dict or None per row) becomes (row, token, value) entries, and
        `token_bitmask` [B, ceil(V/32)] int32 is passed on; each is left out when no row uses
        it, which is the host flag `from_tensors` reads.
        """
        b = len(temperature)
        assert all(len(x) == b for x in (top_k, top_p, min_p, seed, step))
        seeds = [((s + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63) for s in seed]
        out = {"temperature": np.array(temperature, dtype=np.float32),
               "top_k": np.array(top_k, dtype=np.int32),
               "top_p": np.array(top_p, dtype=np.float32),
               "min_p": np.array(min_p, dtype=np.float32),
               "seed": np.array(seeds, dtype=np.int64), "step": np.array(step, dtype=np.int64)}
        entries = [(i, t, v) for i, d in enumerate(logit_bias or ()) for t, v in (d or {}).items()]
        if entries:
            rows, tokens, values = zip(*entries)
            out["bias_rows"] = np.array(rows, dtype=np.int64)
            out["bias_tokens"] = np.array(tokens, dtype=np.int64)
            out["bias_values"] = np.array(values, dtype=np.float32)
        if token_bitmask is not None:
            assert token_bitmask.dtype == np.int32 and token_bitmask.shape[0] == b
            out["token_bitmask"] = token_bitmask
        return out

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], arrays: dict[str, np.ndarray],
                     num_logprobs: int, penalties: PenaltyBatch | None = None) -> SamplingBatch:
        """Over uploaded `host_arrays` (`tensors`); the host flags come from `arrays`."""
        need_filters = bool((arrays["top_k"] > 0).any() or (arrays["top_p"] < 1.0).any()
                            or (arrays["min_p"] > 0).any())
        return SamplingBatch(
            temperature=tensors["temperature"], top_k=tensors["top_k"], top_p=tensors["top_p"],
            min_p=tensors["min_p"], seed=tensors["seed"], step=tensors["step"],
            num_logprobs=num_logprobs,
            all_greedy=bool((arrays["temperature"] < GREEDY_EPS).all()),
            need_filters=need_filters, token_bitmask=tensors.get("token_bitmask"),
            bias_rows=tensors.get("bias_rows"), bias_tokens=tensors.get("bias_tokens"),
            bias_values=tensors.get("bias_values"), penalties=penalties)

    @staticmethod
    def from_lists(temperature: list[float], top_k: list[int], top_p: list[float],
                   min_p: list[float], seed: list[int], step: list[int], num_logprobs: int,
                   device: torch.device | str, *,
                   logit_bias: list[dict[int, float] | None] | None = None,
                   token_bitmask: np.ndarray | None = None) -> SamplingBatch:
        """Host lists -> device parameters with one upload (`host_upload.upload`)."""
        arrays = SamplingBatch.host_arrays(temperature, top_k, top_p, min_p, seed, step,
                                           logit_bias=logit_bias, token_bitmask=token_bitmask)
        return SamplingBatch.from_tensors(upload(arrays, device), arrays, num_logprobs)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: raw-logit log-softmax at the sampled token
    topk_ids: torch.Tensor | None  # [B, num_logprobs] int64, by raw logprob, descending
    topk_logprobs: torch.Tensor | None  # [B, num_logprobs] float32


def apply_filters(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set filtered entries of temperature-scaled ``logits`` [B, V] float32 to -inf (new tensor).

    top_k [B] int (<= 0 or >= V: off), top_p [B] float32 (>= 1: off), min_p [B] float32
    (<= 0: off). Applied in the order top-k, top-p, min-p; each becomes a per-row threshold on the
    logit value and a token is kept iff it is >= every threshold, so boundary ties are kept.
    """
    v = logits.shape[-1]
    srt = torch.sort(logits, dim=-1, descending=True).values  # [B, V]
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > v), v, k)
    thr_k = srt.gather(1, (k - 1)[:, None])  # [B, 1]; k-th largest value
    srt_k = srt.masked_fill(srt < thr_k, float("-inf"))
    probs = torch.softmax(srt_k, dim=-1)
    excl = torch.cumsum(probs, dim=-1).sub_(probs)  # probability mass strictly before each token
    p = top_p.to(torch.float32)[:, None]
    n_keep = (excl < p).sum(dim=-1, keepdim=True).clamp_(min=1)  # [B, 1]; a prefix, top kept
    n_keep = torch.where(p >= 1.0, v, n_keep)
    thr_p = srt.gather(1, n_keep - 1)
    thr_min = srt[:, :1] + torch.log(min_p.to(torch.float32).clamp(0.0, 1.0))[:, None]  # -inf if 0
    thr = torch.maximum(torch.maximum(thr_k, thr_p), thr_min)
    return logits.masked_fill(logits < thr, float("-inf"))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw-logit logprobs, also used for prompt logprobs.

    logits [N, V] (any float dtype; math in float32), token_ids [N] int -> (logprob of each target
    [N] float32, top-k ids [N, k] int64, top-k logprobs [N, k] float32) with
    k = min(num_logprobs, V), descending; the last two are None when num_logprobs == 0.
    """
    # the targets' logprobs and the logsumexp: one launch on CUDA, no float32 copy of the logits
    lp, lse = row_logprobs(logits, token_ids)
    if num_logprobs <= 0:
        return lp, None, None
    return (lp, *top_logprobs(logits, lse, num_logprobs))


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor, num_logprobs: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k = min(num_logprobs, V) most likely tokens of each row of logits [N, V] and their
    logprobs given the rows' logsumexp lse [N]: ([N, k] int64, [N, k] float32), descending."""
    vals, ids = torch.topk(logits.float(), min(num_logprobs, logits.shape[-1]), dim=-1)
    return ids, vals - lse[:, None]  # same order as log_softmax


RANK_BLOCK_ROWS = 256  # rows per comparison in token_ranks: a [256, V] bool at a time


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The vocabulary rank of each target: logits [N, V], token_ids [N] -> [N] int64, the
    number of entries of the row at least as large as the target's logit (1: the likeliest; a
    tie ranks the target last among the equals), as vLLM ranks. Compares the raw logits (the
    order of their logprobs), in blocks of rows whose sizes are host ints: no sync."""
    ids = token_ids.to(torch.int64)[:, None]
    out = [torch.zeros(0, dtype=torch.int64, device=logits.device)]
    for s in range(0, logits.shape[0], RANK_BLOCK_ROWS):
        rows = logits[s:s + RANK_BLOCK_ROWS]
        out.append((rows >= rows.gather(1, ids[s:s + RANK_BLOCK_ROWS])).sum(-1))
    return out[-1] if len(out) == 2 else torch.cat(out)


def process_logits(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The token mask, logit_bias and penalties of the rows that use them (out of place; `x`
    itself when the step uses none). Resets the penalty rows handed out this step first."""
    if batch.token_bitmask is not None:
        x = apply_token_bitmask(x, batch.token_bitmask)
    if batch.bias_rows is not None:
        x = apply_logit_bias(x, batch.bias_rows, batch.bias_tokens, batch.bias_values)
    if batch.penalties is not None:
        batch.penalties.prepare()
        x = batch.penalties.apply(x)
    return x


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Sample one token per row. logits [B, V] (float32, or bf16/fp16: upcast to float32).

    Returns token ids [B] int64 and raw logprobs; no host syncs, shapes depend on host ints only.
    With penalties, the sampled tokens are counted into their requests' rows on the device.
    """
    proc = process_logits(logits.float(), batch) if batch.processes_logits else logits
    temperature = batch.temperature
    if batch.need_filters and not batch.all_greedy:
        # the filters (torch: they sort) on the rows' scaled logits; the op then divides by 1.
        # A greedy row's maximum survives every filter, so its argmax is proc's.
        is_greedy = temperature < GREEDY_EPS
        scaled = proc.float() / torch.where(is_greedy, 1.0, temperature)[:, None]
        proc = apply_filters(scaled, batch.top_k, batch.top_p, batch.min_p)
        temperature = torch.where(is_greedy, 0.0, 1.0)
    # the token and its raw logprob in one op (ops/sample_rows.py: one launch on CUDA)
    ids, lp, lse = sample_rows(logits, proc, temperature, batch.seed, batch.step,
                               batch.all_greedy)
    if batch.penalties is not None:
        batch.penalties.record(ids)
    topk_ids = topk_lp = None
    if batch.num_logprobs > 0:
        topk_ids, topk_lp = top_logprobs(logits, lse, batch.num_logprobs)
    return SamplerOutput(token_ids=ids, logprobs=lp, topk_ids=topk_ids, topk_logprobs=topk_lp)
