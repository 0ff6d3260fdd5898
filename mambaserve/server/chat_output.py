"""One chat choice's generated text -> the assistant message OpenAI clients read: `content`,
`reasoning_content` (--reasoning-parser) and `tool_calls` (--tool-call-parser, or a forced
tool_choice), whole (`message`) or as streamed deltas (`delta`).

The reasoning parser splits the text first; the tool parser reads the content part. Streamed
deltas are the differences between parses of the text sent so far, so the concatenated deltas
equal the final message: tool calls are announced (index, id, type, function.name, empty
arguments) once their name is complete, then their arguments follow in chunks, as OpenAI
streams them. A tool-call region that turns out not to be well-formed once the output has ended
becomes content (non-streamed); a stream that already announced calls cannot take them back.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from mambaserve.server.reasoning_parsers import ThinkReasoningParser
from mambaserve.server.tool_parsers import ToolCall, ToolParser

logger = logging.getLogger("mambaserve.server")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatOutputSpec:
    """How a request's chat output is read: built by the protocol, one per request."""

    tool_parser: ToolParser | None = None
    reasoning: ThinkReasoningParser | None = None
    echo: str = ""  # vLLM's chat echo: the last message's content (of `role`), prepended
    include_reasoning: bool = True  # vLLM's include_reasoning: false leaves the reasoning out
    role: str = "assistant"  # the message's role (vLLM: the last message's without a
    # generation prompt)


class ChatChoiceOutput:
    def __init__(self, spec: ChatOutputSpec | None) -> None:
        self.spec = spec or ChatOutputSpec()
        self.sent_reasoning = ""
        self.sent_content = ""
        self.call_ids: list[str] = []  # announced calls
        self.sent_args: list[str] = []
        self.diverged = False
        self.called_tools = False  # the final parse found tool calls (finish_reason tool_calls)

    def _parse(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = "", text
        if self.spec.reasoning is not None:
            reasoning, content = self.spec.reasoning.split(text, final)
        calls: list[ToolCall] = []
        if self.spec.tool_parser is not None:
            parsed = self.spec.tool_parser.parse(content, final)
            content, calls = parsed.content, parsed.calls
        return reasoning, self.spec.echo + content, calls

    # ---- non-streamed ------------------------------------------------------------------------
    def message(self, text: str) -> tuple[dict, bool]:
        """The final message of `text` -> (message fields, whether it called tools)."""
        reasoning, content, calls = self._parse(text, True)
        msg: dict = {"role": self.spec.role, "content": content, "refusal": None}
        if self.spec.reasoning is not None:
            msg["reasoning_content"] = (reasoning or None) if self.spec.include_reasoning \
                else None
        tool_calls = [{"id": tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        msg["tool_calls"] = tool_calls
        if not content and (tool_calls or reasoning):
            msg["content"] = None  # as vLLM: no text besides the calls / the reasoning
        return msg, bool(tool_calls)

    # ---- streamed ----------------------------------------------------------------------------
    def echo_delta(self) -> dict:
        """The echoed text as its own delta, sent (as vLLM does) right after the role chunk,
        before anything is generated; {} without echo."""
        if not self.spec.echo:
            return {}
        self.sent_content = self.spec.echo
        return {"content": self.spec.echo}

    def delta(self, text: str, final: bool) -> dict:
        """The delta message for `text` (everything sent so far plus what is new); {} when
        there is nothing new."""
        reasoning, content, calls = self._parse(text, final)
        if final:
            self.called_tools = bool(calls)
        out: dict = {}
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            if self.spec.include_reasoning:
                out["reasoning_content"] = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content):
            if len(content) > len(self.sent_content):
                out["content"] = content[len(self.sent_content):]
                self.sent_content = content
        elif not self.diverged:
            self.diverged = True  # tool calls announced, then the region was not well-formed
            logger.warning("a streamed tool call turned out not to be well-formed; the rest of "
                           "the choice's text is not sent")
        entries = []
        for i, call in enumerate(calls):
            entry: dict = {}
            if i == len(self.call_ids) and call.name is not None:
                self.call_ids.append(tool_call_id())
                self.sent_args.append("")
                entry = {"index": i, "id": self.call_ids[i], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            if i < len(self.call_ids):
                sent = self.sent_args[i]
                if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                    entry.setdefault("index", i)
                    entry.setdefault("function", {})["arguments"] = call.arguments[len(sent):]
                    self.sent_args[i] = call.arguments
            if entry:
                entries.append(entry)
        if entries:
            out["tool_calls"] = entries
        return out
