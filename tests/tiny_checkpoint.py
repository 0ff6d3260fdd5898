"""Tiny random-weight NemotronH checkpoints saved by transformers (the reference), for tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_KW = dict(
    vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
    conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
    initializer_range=0.08, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)
TINY_LAYERS = ["linear_attention", "moe", "linear_attention", "full_attention", "mlp",
               "linear_attention", "full_attention", "mlp"]


def make_tiny_checkpoint(path: Path, seed: int = 0, layers: list[str] | None = None,
                         **overrides) -> Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = NemotronHConfig(layers_block_type=layers or TINY_LAYERS, **{**TINY_KW, **overrides})
    model = NemotronHForCausalLM(cfg).eval()
    # transformers initialises the router bias to zero; give it values so the biased choice is tested
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(path)
    return path


def load_hf(path: Path):
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


SPECIALS = ["<pad>", "<s>", "</s>"]


def add_byte_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """A byte-level tokenizer (ids 0-2 special, one token per byte, no merges) with a chat
    template, written as tokenizer.json + tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}",
    }))
    return path
