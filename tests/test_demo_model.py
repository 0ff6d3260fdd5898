"""The embedded demo model (mambaserve/assets/demo_model) through the engine, against HF
transformers in float32 on the CPU: held-out perplexity, greedy continuations, and the
`mambaserve generate` command producing Shakespeare-like words.

Fixtures (tests/fixtures/, rebuilt by make_demo_fixtures.py from .demo_build/): heldout.txt is
Twelfth Night Act I scenes 1-2 (a validation play); demo_vocab.txt the words seen >= 2 times in
the training split."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mambaserve.default_model import DEMO_MODEL_DIR

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parent.parent
WORD_RE = re.compile(r"[a-z']+")


@pytest.fixture(scope="module")
def demo_llm():
    from mambaserve import LLM

    return LLM(None, dtype="float32")


@pytest.fixture(scope="module")
def demo_hf():
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_heldout_perplexity_matches_hf(demo_llm, demo_hf):
    from mambaserve.tools.eval import perplexity, split_windows

    text = (FIXTURES / "heldout.txt").read_text()
    res = perplexity(demo_llm, text, window=512)
    ids = demo_llm.get_tokenizer().encode(text)
    windows = split_windows(ids, 512)
    assert res["windows"] == len(windows) == 4
    assert res["tokens_scored"] == len(ids) - len(windows)

    nll = 0.0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            logp = torch.log_softmax(demo_hf(input_ids=x).logits.float(), dim=-1)
            nll -= logp[0, :-1].gather(-1, x[0, 1:, None]).sum().item()
    hf_ppl = math.exp(nll / res["tokens_scored"])
    assert res["nll"] == pytest.approx(nll, rel=1e-3)
    assert res["perplexity"] == pytest.approx(hf_ppl, rel=1e-3)
    # a trained model, not a random one: it scores ~42 here (uniform over the vocab: 4096)
    assert 20 < res["perplexity"] < 80


@pytest.mark.parametrize("prompt", ["ROMEO:", "DUKE.\nIf music be the food of love, play on,\n"])
def test_greedy_continuation_matches_hf(demo_llm, demo_hf, prompt):
    from mambaserve import SamplingParams

    n = 40
    out = demo_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n))[0]
    ids = demo_llm.get_tokenizer().encode(prompt)
    with torch.no_grad():
        x = torch.tensor([ids])
        hf = demo_hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=n, pad_token_id=0)
    hf_new = hf[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == hf_new
    assert len(hf_new) == n  # no early eos: the whole window was compared


def _vocab_share(text: str, vocab: set[str]) -> tuple[float, int]:
    words = WORD_RE.findall(text.lower())
    return sum(w in vocab for w in words) / max(len(words), 1), len(words)


def test_cli_generate_writes_corpus_words():
    vocab = set((FIXTURES / "demo_vocab.txt").read_text().split())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mambaserve.cli", "generate", "ROMEO:", "--max-tokens", "60"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 60, f"generate took {elapsed:.1f} s"  # a sanity bound, not a benchmark
    text = proc.stdout.rsplit("-" * 40, 1)[0]
    assert text.startswith("ROMEO:")
    share, n = _vocab_share(text[len("ROMEO:"):], vocab)
    # Measured (seeds 0-99, temperature 0.8, top_p 0.95, 60 tokens): median 1.0, 5th percentile
    # 0.89, lowest two 0.72 and 0.78, 18-40 words. The pinned default seed (0) scores 1.0.
    # Random token ids decoded score median 0.42, max 0.61 over 300 draws; a random-weight model
    # of the same config 0.33-0.50.
    assert n >= 10, text
    assert share >= 0.75, (share, text)

    # the control: decoded random tokens fail the same threshold
    from mambaserve.engine.tokenizer import Tokenizer

    tok = Tokenizer(DEMO_MODEL_DIR)
    rng = random.Random(0)
    for _ in range(20):
        junk = tok.decode([rng.randrange(4, tok.vocab_size) for _ in range(60)])
        assert _vocab_share(junk, vocab)[0] < 0.75
