"""A tiny NemotronH checkpoint whose greedy output is forced: a bigram model built from weights.

Every mixer and MLP output projection is zero, so the hidden state after the last layer is the
current token's embedding and the logits are `lm_head @ norm_f(embedding[token])`. `lm_head`
row `b` is set to (a multiple of) the normalized hidden state of each token `a` that must be
followed by `b`, so greedy decoding walks fixed chains of tokens. The chains are made of added
tokens (whole strings such as `<TOOLCALL>[`), each with exactly one successor, and end at EOS.
The chat template ends the prompt with a token that picks the chain: the last character of the
last message, or `<think>` / `<think></think>` for system prompts with `/think` / `/no_think`
(chat_template_kwargs enable_thinking=false renders `<think></think>` too).

The engine runs this checkpoint unchanged (no hook in the serving code): the outputs are real
generations whose text the parsers then read, token by token when streamed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from tiny_checkpoint import add_byte_tokenizer, make_tiny_checkpoint

EOS = "</s>"
# selector (the prompt's last token) -> the chain of added tokens generated after it
CHAINS = {
    "1": ["Let me check.", "\n<TOOLCALL>[", '{"name": "get_weather", "arguments": ',
          '{"city": ', '"Paris"}', "}]</TOOLCALL>"],
    "2": ['<TOOLCALL>[{"name": "add", ', '"arguments": {"a": 1, "b": 2}}, ',
          '{"name": "mul", "arguments": {"a": 3, ', '"b": 4}}]', "</TOOLCALL>"],
    "3": ["<tool_call>\n", '{"name": "get_time", "arguments": {"tz": ', '"UTC"}}\n',
          "</tool_call>"],
    "4": ["No tools needed", ", thanks."],
    "5": ['<TOOLCALL>[{"name": "get_weather", "arguments": {"city"', ": }]</TOOLCALL>"],
    "<think>": ["The user wants a greeting.", "</think>", "Hello there!"],
}
TEMPLATE = (
    "{%- set ns = namespace(think='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and '/no_think' in m['content'] %}{% set ns.think = 'off' %}"
    "{%- elif m['role'] == 'system' and '/think' in m['content'] %}{% set ns.think = 'on' %}"
    "{%- endif -%}"
    "{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
    "{% if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}\n"
    "{%- endfor -%}"
    "{%- if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif -%}"
    "{%- if add_generation_prompt -%}assistant: "
    "{%- if ns.think == 'on' and enable_thinking is not false %}<think>"
    "{%- elif ns.think %}<think></think>"
    "{%- else %}{{ messages[-1]['content'][-1] }}{% endif -%}"
    "{%- endif -%}")
EXPECTED = {k: "".join(v) for k, v in CHAINS.items()}


def make_forced_checkpoint(path: Path, scale: float = 40.0) -> Path:
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    make_tiny_checkpoint(path, seed=3, layers=["linear_attention", "mlp"])
    add_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    pieces = ["<think>", "</think>"] + [p for chain in CHAINS.values() for p in chain]
    tok.add_tokens([AddedToken(p, normalized=False) for p in dict.fromkeys(pieces)])
    tok.save(str(path / "tokenizer.json"))
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_file.write_text(json.dumps(cfg))

    def tid(piece: str) -> int:
        ids = tok.encode(piece, add_special_tokens=False).ids
        assert len(ids) == 1, (piece, ids)
        return ids[0]

    file = path / "model.safetensors"
    sd = load_file(file)
    for k in sd:
        if k.endswith(("out_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    emb = sd["backbone.embeddings.weight"] = torch.randn_like(sd["backbone.embeddings.weight"])
    norm_w = sd["backbone.norm_f.weight"]
    hidden = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    head = torch.zeros_like(sd["lm_head.weight"])
    successor: dict[int, int] = {}
    for sel, chain in CHAINS.items():
        ids = [tid(sel)] + [tid(p) for p in chain] + [tid(EOS)]
        for a, b in itertools.pairwise(ids):
            assert successor.setdefault(a, b) == b, f"token {a} has two successors"
    for a, b in successor.items():
        head[b] += scale * hidden[a] / hidden[a].pow(2).sum()
    sd["lm_head.weight"] = head
    save_file(sd, str(file), metadata={"format": "pt"})
    return path
