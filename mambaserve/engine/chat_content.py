"""Chat message content for the template, shared by the server and `LLM.chat`: an array of
content parts read as one string (vLLM's "string" content format), and the template variable
names that chat_template_kwargs may not set. Pure functions; no server import.
"""

from __future__ import annotations

# template variables that chat_template_kwargs may not set (vLLM refuses chat_template and
# tokenize there too)
RESERVED = ("messages", "tools", "add_generation_prompt", "continue_final_message",
            "bos_token", "eos_token", "raise_exception", "strftime_now", "chat_template",
            "tokenize")

# the part types read as text, and the field that holds each one's text (vLLM's MM_PARSER_MAP)
TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}
# a part of these types with no text (the field missing or null) is left out, as vLLM does
SKIP_WHEN_MISSING = ("text", "refusal")


class ContentPartError(ValueError):
    """A content part this engine cannot read; `index` is its place in the array."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def join_text_parts(parts: list) -> str:
    """The text of the parts, a line apart. Raises ContentPartError for a part that is not a
    text-like part with a string in its field (image, audio, video and unknown types)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_FIELDS.get(kind) if isinstance(kind, str) else None
        value = part.get(field) if field is not None else None
        if value is None and kind in SKIP_WHEN_MISSING:
            continue
        if not isinstance(value, str):
            raise ContentPartError(j, "only text parts ({\"type\": \"text\", \"text\": ...}; "
                                      "also input_text, output_text, refusal, thinking) are "
                                      "supported")
        texts.append(value)
    return "\n".join(texts)


def check_template_kwargs(kwargs: dict) -> None:
    """Raises ValueError naming the first key chat_template_kwargs may not set."""
    for k in kwargs:
        if not isinstance(k, str) or k in RESERVED or not k.isidentifier():
            raise ValueError(f"chat_template_kwargs may not set {k!r}")
