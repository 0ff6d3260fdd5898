"""End-to-end check of the engine on a CUDA GPU (run through the device tool):
the Triton kernels inside the real engine against transformers on a tiny random NemotronH, then
on a tiny random checkpoint of every other family (tests/family_checkpoints.py): fp32 eager, and
fp32 with decode CUDA graphs and prefix caching, greedy tokens and prompt logprobs; and fresh
300-token prompts in bf16 with the prefill attention through torch SDPA and through the tiled
kernel.

    python scripts/gpu_check.py --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from family_checkpoints import MAKERS  # noqa: E402
from family_checkpoints import load_hf as load_family_hf  # noqa: E402
from tiny_checkpoint import add_byte_tokenizer, load_hf, make_tiny_checkpoint  # noqa: E402

from mambaserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ckpt = add_byte_tokenizer(make_tiny_checkpoint(tmp / "tiny", seed=0, chunk_size=16,
                                                   mamba_head_dim=16, ssm_state_size=16))
    hf = load_hf(ckpt)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 19, 41, 70, 12)]
    n_new = 24
    ref = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=n_new, min_new_tokens=n_new,
                          do_sample=False)
        ref.append(out[0, len(p):].tolist())
    with torch.no_grad():
        ref_lp = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    from transformers import NemotronHForCausalLM

    hf16 = NemotronHForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref_lp16 = [torch.log_softmax(hf16(torch.tensor([p])).logits[0].float(), -1)
                    for p in prompts]
    hf16_err = max((a - b).abs().max().item() for a, b in zip(ref_lp16, ref_lp))
    report = {"hf_bf16_vs_hf_fp32_max_logprob_err": hf16_err}
    report |= {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    greedy = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, prompt_logprobs=0)
    for name, kw in [("fp32", dict(dtype="float32")),
                     ("fp32_prefix_cache", dict(dtype="float32", enable_prefix_caching=True)),
                     ("fp32_cuda_graphs", dict(dtype="float32", enforce_eager=False)),
                     ("fp32_cuda_graphs_prefix_cache", dict(dtype="float32", enforce_eager=False,
                                                            enable_prefix_caching=True)),
                     ("bf16", dict(dtype="bfloat16"))]:
        llm = LLM(ckpt, device=args.device, chunked_prefill_size=16, max_num_seqs=3, **kw)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        dt = time.perf_counter() - t0
        same = [o.outputs[0].token_ids == r for o, r in zip(outs, ref)]
        if "prefix" in name:  # the same prompts again (no prompt logprobs): cache hits
            plain = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
            again = llm.generate([{"prompt_token_ids": p} for p in prompts], plain)
            same += [o.outputs[0].token_ids == r for o, r in zip(again, ref)]
        lp_err = max(abs(d[t] - lp[i, t].item())
                     for o, lp, p in zip(outs, ref_lp, prompts)
                     for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:])))
        first_div = [next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, r))
                           if a != b), None) for o, r in zip(outs, ref)]
        report[name] = {"greedy_identical": same, "first_divergence": first_div,
                        "max_prompt_logprob_err": lp_err, "seconds": dt,
                        "stats": llm.engine.stats, "cache": llm.engine.cache_stats()}
        if name == "bf16":
            report[name]["max_prompt_logprob_err_vs_hf_bf16"] = max(
                abs(d[t] - lp[i, t].item())
                for o, lp, p in zip(outs, ref_lp16, prompts)
                for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:])))
        print(name, report[name], flush=True)
    report |= dense_prefill(ckpt, hf, hf16, args.device)
    from mambaserve.config import SUPPORTED_ARCHITECTURES

    for arch, make in MAKERS.items():
        if arch not in SUPPORTED_ARCHITECTURES:
            report[arch] = "not supported"
            continue
        report[arch] = check_family(arch, make(tmp / arch, seed=0), args.device)
        print(arch, report[arch], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    from mambaserve.cli import main as cli

    rc = cli(["audit-syncs", "--model", str(ckpt), "--device", args.device, "--dtype", "float32",
              "--chunked-prefill-size", "16"])
    print("audit-syncs exit code", rc)


def dense_prefill(ckpt: Path, hf, hf16, device: str) -> dict:
    """Fresh prompts of >= 256 tokens in bf16, eager (one prefill step each): the attention
    through torch SDPA (the default) and through the tiled paged kernel
    (MAMBASERVE_DENSE_PREFILL=0); prompt logprob errors against transformers fp32 and bf16."""
    from mambaserve.ops.paged_attention import DENSE_PREFILL_ENV

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (300, 260)]
    with torch.no_grad():
        ref = [torch.log_softmax(m(torch.tensor([p])).logits[0].float(), -1)
               for m in (hf, hf16) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    out = {"hf_bf16_vs_hf_fp32_fresh_rows": max((a - b).abs().max().item()
                                                for a, b in zip(ref[2:], ref[:2]))}
    for name, switch in [("bf16_fresh_rows_dense", "1"), ("bf16_fresh_rows_paged", "0")]:
        os.environ[DENSE_PREFILL_ENV] = switch
        try:
            llm = LLM(ckpt, device=device, dtype="bfloat16", enforce_eager=True,
                      chunked_prefill_size=1024, max_num_seqs=2)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        finally:
            os.environ.pop(DENSE_PREFILL_ENV)
        errs = [max(abs(d[t] - lp[i, t].item())
                    for o, lp, p in zip(outs, refs, prompts)
                    for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:])))
                for refs in (ref[:2], ref[2:])]
        out[name] = {"max_prompt_logprob_err": errs[0],
                     "max_prompt_logprob_err_vs_hf_bf16": errs[1]}
        print(name, out[name], flush=True)
    return out


def check_family(arch: str, ckpt: Path, device: str) -> dict:
    """The engine on `device` against transformers (CPU, fp32) for one family's checkpoint."""
    hf = load_family_hf(ckpt)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 19, 41, 12)]
    n_new = 16
    with torch.no_grad():
        ref_lp = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
        ref = []
        for p in prompts:  # greedy by full recompute (transformers' Mamba2 generate() can stop
            seq = list(p)  # early on long prompts)
            for _ in range(n_new):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            ref.append(seq[len(p):])
    greedy = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, prompt_logprobs=0)
    out = {}
    for name, kw in [("fp32", dict(enforce_eager=True)),
                     ("fp32_cuda_graphs_prefix_cache", dict(enforce_eager=False,
                                                            enable_prefix_caching=True))]:
        llm = LLM(ckpt, device=device, dtype="float32", chunked_prefill_size=16, max_num_seqs=3,
                  **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        lp_err = max(abs(d[t] - lp[i, t].item())
                     for o, lp, p in zip(outs, ref_lp, prompts)
                     for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:])))
        out[name] = {"greedy_identical": [o.outputs[0].token_ids == r
                                          for o, r in zip(outs, ref)],
                     "max_prompt_logprob_err": lp_err, "stats": llm.engine.stats}
    return out


if __name__ == "__main__":
    main()
