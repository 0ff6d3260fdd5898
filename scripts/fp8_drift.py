"""FP8-vs-unquantized logprob drift: the prompt logprobs of the same model loaded twice, once as
is and once with on-the-fly FP8 (`quantization="fp8"`), over ~2k prompt tokens; prints and
writes mean and max |delta logprob| (and greedy agreement over a few continuations).

    python scripts/fp8_drift.py --preset nemotron-nano-9b-v2 --device cuda --dtype bfloat16
    python scripts/fp8_drift.py --model mambaserve/assets/demo_model --device cuda
    python scripts/fp8_drift.py --preset tiny --device cpu --dtype float32 --tokens 256  # smoke

The preset has random weights (drawn in the target dtype on the device, the same seed for both
loads), so its drift measures the quantization error on a random network, not on trained text.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from mambaserve import LLM, SamplingParams


def prompts(vocab: int, total: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, total // length)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def prompt_logprobs(llm: LLM, batch: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    sp = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp)
    lps = [torch.tensor([d[t] for d, t in zip(o.prompt_logprobs[1:], p[1:])])
           for o, p in zip(outs, batch)]
    return torch.cat(lps), [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens in all")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    a = ap.parse_args(argv)

    tmp = None
    kw = dict(device=a.device, dtype=a.dtype, seed=a.seed, max_num_seqs=8,
              chunked_prefill_size=4096, max_model_len=a.prompt_len + 64)
    if a.preset:
        from mambaserve.bench.presets import materialize_preset
        from mambaserve.config import resolve_device, resolve_dtype

        path, load_format, tmp = materialize_preset(
            a.preset, None, dtype=resolve_dtype(a.dtype),
            device=torch.device(resolve_device(a.device)), seed=a.seed)
        kw["load_format"] = load_format
    else:
        path = Path(a.model)
    try:
        results = {}
        for q in (None, "fp8"):
            llm = LLM(path, quantization=q, **kw)
            batch = prompts(llm.engine.model_config.vocab_size, a.tokens, a.prompt_len, a.seed)
            results[q] = prompt_logprobs(llm, batch)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        if tmp is not None:
            tmp.cleanup()
    (base, base_tok), (fp8, fp8_tok) = results[None], results["fp8"]
    d = (fp8 - base).abs()
    agree = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
             for s, t in zip(base_tok, fp8_tok)]
    figures = {"model": a.model or a.preset, "device": a.device, "dtype": a.dtype,
               "tokens": int(d.numel()), "mean_abs_dlogprob": d.mean().item(),
               "max_abs_dlogprob": d.max().item(), "p99_abs_dlogprob": d.quantile(0.99).item(),
               "greedy_tokens_equal_before_first_difference": agree}
    print(json.dumps(figures))
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
