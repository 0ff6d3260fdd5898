"""Evaluation tools run through the engine: `mambaserve eval perplexity` and `mambaserve eval qa`.

perplexity: the text is tokenized with the model's tokenizer and split into consecutive,
non-overlapping windows of `window` tokens (the last one may be shorter). Every window is one
prompt of a single batched generate call with `prompt_logprobs=0, max_tokens=1`; the NLL is
minus the sum of the prompt logprobs of tokens 1..len-1 of every window (token 0 of a window has
no context and is not scored).

qa: GSM8K-format JSONL (`{"question": ..., "answer": "... #### 42"}`). The first `shots` items
form a few-shot prompt ("Question: ...\\nAnswer: <full answer>\\n\\n" each) and are not scored;
the rest are answered greedily (stop at "Question:"), the answer is the number after "####" if
the output has one, else the last number in it, and it is compared with the reference as an
exact rational number after stripping "$", "," and a trailing ".".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

# ---- perplexity ------------------------------------------------------------------------------


def split_windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens; a last window of fewer than two
    tokens is dropped (it has nothing to score)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    wins = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in wins if len(w) >= 2]


def window_nll(window: list[int], prompt_logprobs: list[dict[int, float] | None]) -> float:
    """Minus the sum of the logprobs of tokens 1..len-1 of one window."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(window):
        raise ValueError("prompt_logprobs must be aligned with the prompt")
    return -sum(lp[t] for t, lp in zip(window[1:], prompt_logprobs[1:]))


def perplexity(llm, text: str | None = None, ids: list[int] | None = None, window: int = 512,
               max_tokens: int | None = None, use_tqdm: bool = False,
               model_name: str | None = None) -> dict:
    """Perplexity of `text` (or of token `ids`) under the engine `llm` (a mambaserve.LLM).
    `max_tokens` keeps only the first N tokens of the text."""
    from mambaserve.engine.sampling_params import SamplingParams

    if (text is None) == (ids is None):
        raise ValueError("pass exactly one of text or ids")
    if ids is None:
        tok = llm.get_tokenizer()
        if tok is None:
            raise ValueError("this model has no tokenizer.json; pass token ids")
        ids = tok.encode(text)
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        ids = ids[:max_tokens]
    windows = split_windows(list(ids), window)
    if not windows:
        raise ValueError(f"the text has {len(ids)} token(s): nothing to score")
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=use_tqdm)
    seconds = time.perf_counter() - t0
    nll = sum(window_nll(w, o.prompt_logprobs) for w, o in zip(windows, outs))
    scored = sum(len(w) - 1 for w in windows)
    loss = nll / scored
    return {"tokens_scored": scored, "nll": nll, "loss": loss, "perplexity": math.exp(loss),
            "windows": len(windows), "window": window, "model": model_name,
            "seconds": round(seconds, 3)}


# ---- qa (GSM8K format) -----------------------------------------------------------------------

NUMBER_RE = re.compile(r"-?\$?\d+(?:,\d{3})*(?:\.\d+)?")
QA_STOP = ["\n\nQuestion:", "Question:"]


def normalize_number(s: str) -> str:
    """Strip whitespace, "$", "," and a trailing "."; "$1,234.50" -> "1234.50"."""
    s = s.strip().replace("$", "").replace(",", "").strip()
    while s.endswith("."):
        s = s[:-1]
    return s


def to_number(s: str) -> Fraction | None:
    try:
        return Fraction(normalize_number(s))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str, b: str) -> bool:
    """Exact equality as rationals when both parse as numbers, else as normalized strings."""
    fa, fb = to_number(a), to_number(b)
    if fa is not None and fb is not None:
        return fa == fb
    return normalize_number(a) == normalize_number(b)


def extract_answer(text: str) -> str | None:
    """The (normalized) number after the last "####" if there is one, else the last number in
    the text; None when there is no number."""
    if "####" in text:
        m = NUMBER_RE.search(text.rsplit("####", 1)[1])
        if m:
            return normalize_number(m.group())
    found = NUMBER_RE.findall(text)
    return normalize_number(found[-1]) if found else None


def reference_answer(answer: str) -> str:
    if "####" not in answer:
        raise ValueError(f"reference answer has no '####': {answer[-80:]!r}")
    return normalize_number(answer.rsplit("####", 1)[1])


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a file; a ValueError naming the file and the problem otherwise."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: no such file")
    if p.is_dir():
        raise ValueError(f"{path} is a folder, not a file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


def load_jsonl(path: str | Path) -> list[dict]:
    """GSM8K-format items, one JSON object with "question" and "answer" per line (blank lines
    skipped); a ValueError naming the file and line otherwise."""
    items = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg}, column {e.colno}); eval qa reads "
                             f"JSONL, one {{\"question\": ..., \"answer\": \"... #### N\"}} "
                             f"per line") from None
        if not isinstance(item, dict) or "question" not in item or "answer" not in item:
            raise ValueError(f"{path}:{n}: expected an object with 'question' and 'answer'")
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def fewshot_prefix(shots: list[dict]) -> str:
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)


def qa_prompt(prefix: str, question: str) -> str:
    return f"{prefix}Question: {question}\nAnswer:"


def score_qa(items: list[dict], predictions: list[str]) -> dict:
    """Score generated texts against GSM8K-format items (the reference is after "####")."""
    if len(items) != len(predictions):
        raise ValueError(f"{len(items)} items but {len(predictions)} predictions")
    per_item = []
    for item, pred in zip(items, predictions):
        ref = reference_answer(item["answer"])
        got = extract_answer(pred)
        per_item.append({"question": item["question"], "reference": ref, "prediction": pred,
                         "extracted": got, "correct": got is not None and numbers_equal(got, ref),
                         "invalid": got is None})
    num = len(per_item)
    correct = sum(p["correct"] for p in per_item)
    invalid = sum(p["invalid"] for p in per_item)
    return {"num": num, "correct": correct, "accuracy": correct / num if num else 0.0,
            "invalid": invalid, "invalid_rate": invalid / num if num else 0.0,
            "per_item": per_item}


def check_qa(items: list[dict], shots: int, limit: int | None) -> list[dict]:
    """The items to score (after the shots, at most `limit`); a ValueError for bad settings or
    a malformed reference, so nothing is generated for a run that cannot be scored."""
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if len(items) <= shots:
        raise ValueError(f"{len(items)} items: none left to score after {shots} shots")
    test = items[shots:] if limit is None else items[shots:shots + limit]
    for it in test:
        reference_answer(it["answer"])
    return test


def run_qa(llm, items: list[dict], shots: int = 4, max_tokens: int = 256,
           limit: int | None = None, use_tqdm: bool = False,
           model_name: str | None = None) -> dict:
    """Few-shot greedy QA through the engine `llm`; the first `shots` items are the examples."""
    from mambaserve.engine.sampling_params import SamplingParams

    test = check_qa(items, shots, limit)
    prefix = fewshot_prefix(items[:shots])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(QA_STOP))
    t0 = time.perf_counter()
    outs = llm.generate([qa_prompt(prefix, it["question"]) for it in test], params,
                        use_tqdm=use_tqdm)
    seconds = time.perf_counter() - t0
    result = score_qa(test, [o.outputs[0].text for o in outs])
    result.update(model=model_name, shots=shots, seconds=round(seconds, 3))
    return result


# ---- CLI -------------------------------------------------------------------------------------


def _model_name(a) -> str:
    if a.model is not None:
        return str(a.model)
    from mambaserve.default_model import default_model_path

    return str(default_model_path())


def _emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def cli_perplexity(a) -> int:
    """`mambaserve eval perplexity`: the file and the flags are checked before the model loads."""
    from mambaserve import LLM
    from mambaserve.config import EngineConfig

    text = read_text(a.file)
    if a.window < 2:
        raise ValueError(f"--window must be >= 2 tokens, got {a.window}")
    if a.max_tokens is not None and a.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {a.max_tokens}")
    settings = dataclasses.asdict(EngineConfig.from_cli(a))
    llm = LLM(a.model, **settings)
    result = perplexity(llm, text, window=a.window, max_tokens=a.max_tokens, use_tqdm=True,
                        model_name=_model_name(a))
    _emit(result, a.out)
    print(f"[perplexity {result['perplexity']:.3f}  loss {result['loss']:.4f} over "
          f"{result['tokens_scored']} tokens in {result['seconds']:.1f} s]", file=sys.stderr)
    return 0


def cli_qa(a) -> int:
    """`mambaserve eval qa`: the file, its items and the flags are checked before the model
    loads."""
    from mambaserve import LLM
    from mambaserve.config import EngineConfig
    from mambaserve.engine.sampling_params import SamplingParams

    items = load_jsonl(a.file)
    check_qa(items, a.shots, a.limit)
    SamplingParams(max_tokens=a.max_tokens)  # --max-tokens < 1 fails here, not after the load
    settings = dataclasses.asdict(EngineConfig.from_cli(a))
    llm = LLM(a.model, **settings)
    result = run_qa(llm, items, shots=a.shots, max_tokens=a.max_tokens, limit=a.limit,
                    use_tqdm=True, model_name=_model_name(a))
    _emit(result, a.out)
    print(f"[accuracy {result['accuracy']:.3f} ({result['correct']}/{result['num']}), "
          f"invalid {result['invalid']}]", file=sys.stderr)
    return 0
