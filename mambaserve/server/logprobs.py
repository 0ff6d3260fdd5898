"""Logprobs in OpenAI's shapes: the completions API's {tokens, token_logprobs, top_logprobs,
text_offset} (generated tokens, and with `echo` the prompt's tokens first, the first one null)
and the chat API's content list. A logprob below -9999 (or -inf) is sent as -9999.0, as vLLM
does: JSON has no infinity. And vLLM's `prompt_logprobs`: per prompt token (the first null), the
token and its top alternatives keyed by token id, each with its logprob, rank and text."""

from __future__ import annotations

FLOOR = -9999.0


class TokenText:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tok is None:
            return f"token_id:{token_id}"
        return self.tok.token_text(token_id)


def _lp(v: float) -> float:
    return max(FLOOR, v)


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tt: TokenText, token_ids: list[int],
                        lps: list[dict[int, float] | None] | None, start: int, end: int, k: int,
                        offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for tokens [start, end) of `token_ids`, whose
    logprob dicts (the token's own and the top alternatives) are `lps` (an entry None: no
    logprob, as the prompt's first token); -> (object, next text offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    lps = lps or []
    for i in range(start, end):
        tid = token_ids[i]
        d = lps[i] if i < len(lps) else {}
        text = tt(tid)
        tokens.append(text)
        if d is None:
            token_lps.append(None)
            tops.append(None)
        else:
            lp = d.get(tid)
            token_lps.append(None if lp is None else _lp(lp))
            if k:
                top: dict[str, float] = {}
                for t, v in _top(d, k):
                    top.setdefault(tt(t), _lp(v))  # tokens with the same text: the likeliest
                tops.append(top)
            else:
                tops.append(None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def concat_logprobs(a: dict, b: dict) -> dict:
    """Two completions logprobs objects one after the other (the echoed prompt, then the
    generated tokens)."""
    return {key: a[key] + b[key] for key in a}


def _lp_entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tt: TokenText, token_ids: list[int], lps: list[dict[int, float]] | None,
                  start: int, end: int, k: int) -> list:
    out = []
    lps = lps or []
    for i in range(start, end):
        tid = token_ids[i]
        d = lps[i] if i < len(lps) else {}
        e = _lp_entry(tt(tid), d.get(tid, float("-inf")))
        e["top_logprobs"] = [_lp_entry(tt(t), lp) for t, lp in _top(d, k)]
        out.append(e)
    return out


def prompt_logprobs(text, token_ids: list[int], lps: list[dict[int, float] | None],
                    ranks: list[int | None], k: int) -> list:
    """vLLM's `prompt_logprobs`: for each prompt token, None (the first: nothing precedes it) or
    {"<id>": {"logprob", "rank", "decoded_token"}} with the token itself first, then its top `k`
    alternatives ranked 1..k; the token's rank is its vocabulary rank (`ranks`: ties rank it
    last), or its place among the alternatives when it is one. `text(id)`: a token's text (None
    without a tokenizer); -inf is sent as -9999.0, as vLLM does."""
    out: list = []
    for tid, d, rank in zip(token_ids, lps, ranks):
        if d is None:
            out.append(None)
            continue
        top = _top(d, k)
        place = next((i for i, (t, _) in enumerate(top, start=1) if t == tid), rank)
        entries = {str(tid): _prompt_entry(d[tid], place, text(tid))}
        for i, (t, v) in enumerate(top, start=1):
            entries.setdefault(str(t), _prompt_entry(v, i, text(t)))
        out.append(entries)
    return out


def _prompt_entry(lp: float, rank: int, text: str | None) -> dict:
    return {"logprob": FLOOR if lp == float("-inf") else lp, "rank": rank, "decoded_token": text}
