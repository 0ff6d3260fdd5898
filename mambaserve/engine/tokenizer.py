"""Tokenizer from a checkpoint folder: tokenizer.json (HF `tokenizers`) plus the special tokens
and chat template of tokenizer_config.json. transformers is not needed at run time."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise ValueError(f"no tokenizer.json in {path}; pass prompt_token_ids instead of text")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise ValueError(f"cannot read {file}: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(msg: str):
    raise ValueError(msg)
