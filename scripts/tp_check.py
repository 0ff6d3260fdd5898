"""Tensor parallelism against one rank on the same weights: the engine at `--tp N` and at one
rank, on one random checkpoint written once (bf16), each loaded in float32 and in bfloat16, with
CUDA graphs and prefix caching on. Reports, per dtype, whether the greedy tokens are identical,
the largest |Δ prompt logprob| of the N-rank engine against the one-rank engine, and, as the
yardstick of bfloat16, the same between the one-rank bfloat16 and float32 engines; then the
prompts again without prompt logprobs, twice: the second time served from the prefix cache,
against the first.

    python3 scripts/tp_check.py --preset nemotron-nano-9b-v2 --layers 8 --tp 2 --device cuda
    python3 scripts/tp_check.py --preset tiny --tp 2 --device cpu        # gloo: a check

Exit status 0 when float32 agrees within `--fp32-tol` with identical tokens, the bfloat16 N-rank
error is of the yardstick's size (at most `--bf16-factor` times it: both are bfloat16 rounding,
of sums taken in another order or of the whole forward) and every cached rerun repeats its
tokens; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mambaserve.bench.presets import preset_config, write_checkpoint
from mambaserve.config import EngineConfig
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.sampling_params import SamplingParams


def truncated(cfg: dict, layers: int | None) -> dict:
    """The preset with only its first `layers` layers (NemotronH's pattern), or whole."""
    if not layers:
        return cfg
    if "hybrid_override_pattern" not in cfg:
        raise ValueError("--layers needs a NemotronH preset (hybrid_override_pattern)")
    cfg = dict(cfg, num_hidden_layers=layers,
               hybrid_override_pattern=cfg["hybrid_override_pattern"][:layers])
    return cfg


def make_prompts(n: int, vocab: int, shared: int, lens: list[int], seed: int) -> list[list[int]]:
    """n prompts: a shared head of `shared` tokens (prefix-cache hits) then ragged tails."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [head + torch.randint(3, vocab, (lens[i % len(lens)],), generator=g).tolist()
            for i in range(n)]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str,
        prompt_logprobs: bool = True) -> dict:
    """Greedy tokens and (when asked: a request with prompt logprobs computes its whole prompt,
    so it takes no prefix-cache hit) the logprob of each prompt token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            prompt_logprobs=1 if prompt_logprobs else None)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id[len(tag):])] = o
    tokens = [outs[i].outputs[0].token_ids for i in range(len(prompts))]
    # the logprob of each prompt token (position 0 has none)
    lps = [[d[t] for d, t in zip(outs[i].prompt_logprobs[1:], prompts[i][1:], strict=True)]
           if prompt_logprobs else [] for i in range(len(prompts))]
    return {"tokens": tokens, "prompt_logprobs": lps}


def compare(a: dict, b: dict) -> dict:
    same = [x == y for x, y in zip(a["tokens"], b["tokens"], strict=True)]
    first = [next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), None)
             for x, y in zip(a["tokens"], b["tokens"], strict=True)]
    diff = max((abs(p - q) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])
                for p, q in zip(x, y)), default=0.0)
    return {"greedy_identical": sum(same), "of": len(same), "first_divergence": first,
            "max_abs_dlogprob": diff}


def engine_for(path: Path, a: argparse.Namespace, dtype: str, tp: int) -> LLMEngine:
    kw = dict(dtype=dtype, device=a.device, tensor_parallel_size=tp, enable_prefix_caching=True,
              max_num_seqs=max(8, a.prompts), seed=0,
              max_model_len=a.shared + max(a.lens) + a.max_tokens + 64)
    if a.device != "cpu":
        kw["enforce_eager"] = False  # decode and small prefill / mixed graphs
    return LLMEngine(path, EngineConfig(**kw))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="nemotron-nano-9b-v2")
    ap.add_argument("--layers", type=int, default=None, help="keep the first K layers")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--shared", type=int, default=256, help="tokens every prompt starts with")
    ap.add_argument("--lens", default="37,300,129,700", help="the prompts' own tails")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--fp32-tol", type=float, default=1e-4)
    ap.add_argument("--bf16-factor", type=float, default=2.0)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.lens = [int(x) for x in a.lens.split(",")]
    dtypes = a.dtypes.split(",")
    cfg = truncated(preset_config(a.preset), a.layers)
    report: dict = {"preset": a.preset, "layers": cfg["num_hidden_layers"], "tp": a.tp,
                    "device": a.device, "runs": {}, "compare": {}}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_checkpoint(cfg, Path(tmp) / "ckpt", dtype=torch.bfloat16,
                                device="cuda" if a.device.startswith("cuda") else "cpu")
        print(f"checkpoint ({cfg['num_hidden_layers']} layers, bf16) written in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        prompts = make_prompts(a.prompts, cfg["vocab_size"], a.shared, a.lens, seed=1)
        results = {}
        for dtype in dtypes:
            for tp in (1, a.tp):
                t0 = time.perf_counter()
                eng = engine_for(path, a, dtype, tp)
                try:
                    first = run(eng, prompts, a.max_tokens, "a")
                    plain = run(eng, prompts, a.max_tokens, "b", prompt_logprobs=False)
                    again = run(eng, prompts, a.max_tokens, "c", prompt_logprobs=False)  # hits
                    stats = eng.cache_stats()
                finally:
                    eng.close()
                results[dtype, tp] = first
                report["runs"][f"{dtype}/tp{tp}"] = {
                    "seconds": round(time.perf_counter() - t0, 1),
                    "cache_hit_again_vs_first": compare(again, plain),
                    "cache_token_hit_rate": stats.get("token_hit_rate")}
                print(f"{dtype} tp={tp}: done in {time.perf_counter() - t0:.1f} s", flush=True)
        ok = True
        for dtype in dtypes:
            c = compare(results[dtype, a.tp], results[dtype, 1])
            report["compare"][f"{dtype}: tp{a.tp} vs tp1"] = c
            if dtype == "float32":
                ok &= c["greedy_identical"] == c["of"] and c["max_abs_dlogprob"] <= a.fp32_tol
        if {"float32", "bfloat16"} <= set(dtypes):
            y = compare(results["bfloat16", 1], results["float32", 1])
            report["compare"]["bfloat16 vs float32 at tp1 (yardstick)"] = y
            tp_bf16 = report["compare"][f"bfloat16: tp{a.tp} vs tp1"]["max_abs_dlogprob"]
            ok &= tp_bf16 <= a.bf16_factor * max(y["max_abs_dlogprob"], 1e-6)
        for r in report["runs"].values():  # cached reruns give the first run's tokens
            ok &= r["cache_hit_again_vs_first"]["greedy_identical"] == a.prompts
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
