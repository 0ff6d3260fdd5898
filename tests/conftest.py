"""Shared fixtures: one tiny random NemotronH checkpoint (all four layer kinds) per session,
saved by transformers, with a byte-level tokenizer; and the HF model as the reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_checkpoint import add_byte_tokenizer, load_hf, make_tiny_checkpoint  # noqa: E402

# the README's test command runs the suite on two pytest-xdist workers (`-n 2`): one torch thread
# each on the 2-core machine it is sized for; two threads without xdist
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    return add_byte_tokenizer(path)


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    return load_hf(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_llm(tiny_ckpt):
    """A shared engine with a small token budget so chunked prefill and mixed batches happen."""
    from mambaserve import LLM

    return LLM(tiny_ckpt, chunked_prefill_size=24, max_num_seqs=4)
