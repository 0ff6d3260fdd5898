"""Reasoning parsers: the model's text -> (reasoning_content, content), selected with
`--reasoning-parser NAME` (vLLM's names).

`deepseek_r1` (alias `qwen3`): reasoning is the text up to `</think>`, an opening `<think>` in
the output is dropped (templates such as Nemotron-Nano-v2's and Qwen3's open it in the prompt,
so the output starts inside it); without `</think>` the whole output is reasoning (it was cut
short). When the prompt already closed the thinking block (the last of `<think>` / `</think>`
in the rendered prompt is `</think>`: Nemotron's `/no_think` renders `<think></think>`) or the
request passed chat_template_kwargs `enable_thinking: false`, the whole output is content.

A parser reads any prefix of the output (`final=False` while streaming): what it returns for a
prefix is a prefix of what it returns for every longer text (a tag cut at the end of the text
is held back), so streamed deltas are differences of successive parses.
"""

from __future__ import annotations


def _partial(s: str, tag: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-n:]):
            return n
    return 0


class ThinkReasoningParser:
    start, end = "<think>", "</think>"

    def __init__(self, prompt: str = "", template_kwargs: dict | None = None) -> None:
        closed_in_prompt = prompt.rfind(self.end) > prompt.rfind(self.start)
        disabled = (template_kwargs or {}).get("enable_thinking") is False
        self.off = closed_in_prompt or disabled

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """-> (reasoning, content) of `text` (the output so far)."""
        if self.off:
            return "", text
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return "", ""  # maybe an opening tag still arriving
        else:
            body = text
        k = body.find(self.end)
        if k >= 0:
            return body[:k], body[k + len(self.end):]
        if final:
            return body, ""
        return body[:len(body) - _partial(body, self.end)], ""


REASONING_PARSERS = {"deepseek_r1": ThinkReasoningParser, "qwen3": ThinkReasoningParser}


def reasoning_parser_class(name: str) -> type[ThinkReasoningParser]:
    """The parser registered as `name`; ValueError listing the names otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return cls
