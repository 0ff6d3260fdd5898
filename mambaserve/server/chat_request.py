"""A chat request's inputs to the chat template: the messages (text content, an assistant's
`tool_calls`, a tool message's `tool_call_id`), the tools, and the template options
(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `echo`,
`reasoning_effort`, and `chat_template`, a template of the request's own, which only a server
started with --trust-request-chat-template takes); and the template rendering. What the server
was started with (the tool-call and reasoning parsers, the trust flag) is a `ChatConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mambaserve.engine.chat_content import (
    ContentPartError,
    check_template_kwargs,
    join_text_parts,
)
from mambaserve.engine.tokenizer import ChatTemplateError
from mambaserve.server.chat_output import ChatOutputSpec
from mambaserve.server.fields import (
    APIError,
    _describe,
    _type_error,
    check_unicode,
    get_bool,
    get_obj,
    get_str,
)
from mambaserve.server.reasoning_parsers import reasoning_parser_class
from mambaserve.server.tool_choice import ToolRequest, output_parser, parse_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the model's template decides


@dataclass(frozen=True)
class ChatConfig:
    """The server's chat options (`mambaserve serve --tool-call-parser / --reasoning-parser /
    --trust-request-chat-template`)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False  # vLLM's flag: take a request's chat_template


@dataclass
class ChatInputs:
    messages: list[dict]
    tools: ToolRequest | None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    include_reasoning: bool = True
    template: str | None = None  # the request's chat_template ("" or None: the model's)

    @property
    def role(self) -> str:
        """The role of the generated message, as vLLM names it: the assistant's after a
        generation prompt, else the last message's (the model continues that message)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1]["role"]

    def output_spec(self, config: ChatConfig, prompt: str) -> ChatOutputSpec:
        """How the output of this request is read, once its prompt is rendered."""
        reasoning = None
        forced = self.tools is not None and self.tools.choice in ("required", "named")
        # a forced call is constrained from the first token: the output is the call itself
        if config.reasoning_parser is not None and not forced:
            reasoning = reasoning_parser_class(config.reasoning_parser)(
                prompt, self.template_kwargs)
        echo = ""
        last = self.messages[-1]
        if self.echo and last["role"] == self.role and isinstance(last.get("content"), str):
            echo = last["content"]  # vLLM's echo: the last message, when of the same role
        return ChatOutputSpec(output_parser(self.tools, config.tool_call_parser), reasoning,
                              echo, self.include_reasoning, self.role)


def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    if c is None:
        if m.get("role") in ("assistant", "tool"):
            return None if m.get("tool_calls") else ""
        raise APIError(f"messages[{i}].content is required", param=f"messages[{i}].content",
                       code="missing_required_parameter")
    if isinstance(c, str):
        return check_unicode(c, f"messages[{i}].content")
    if isinstance(c, list):
        # one string for the template: the text-like parts a line apart (vLLM's "string"
        # content format; engine/chat_content.py, shared with LLM.chat)
        try:
            text = join_text_parts(c)
        except ContentPartError as e:
            raise APIError(f"messages[{i}].content[{e.index}]: {e}",
                           param=f"messages[{i}].content", code="invalid_value") from None
        return check_unicode(text, f"messages[{i}].content")
    raise _type_error(f"messages[{i}].content", "a string or an array of text parts", c)


def _tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls, for the template: the arguments as an object (the
    convention of Hugging Face templates; a string that is not a JSON object stays one)."""
    calls = m.get("tool_calls")
    p = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _type_error(p, "an array of tool calls", calls)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f'{p}[{j}] must be {{"id": ..., "type": "function", "function": '
                           '{"name": ..., "arguments": "..."}}', param=p, code="invalid_value")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass
        elif not isinstance(args, dict):
            raise _type_error(f"{p}[{j}].function.arguments", "a JSON string", args)
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", param="messages",
                       code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise APIError("'messages' must contain at least one message", param="messages",
                       code="empty_prompt")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                           f"{_describe(role)}", param=f"messages[{i}].role",
                           code="invalid_value")
        msg = {"role": role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = check_unicode(m["name"], f"messages[{i}].name")
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m, i)
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = get_str(m, "tool_call_id")
        messages.append(msg)
    return messages


# OpenAI chat fields this server cannot honour (refused unless null / neutral), and those it
# accepts without effect (checked for type): it stores nothing, has one service tier, no cache
# keys or safety identifiers of its own
REFUSED = {"audio": "audio output", "prediction": "predicted outputs",
           "web_search_options": "web search", "verbosity": "the verbosity hint"}
ACCEPTED = {"metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
            "safety_identifier": str}


def check_openai_fields(body: dict) -> None:
    for name, what in REFUSED.items():
        if body.get(name) is not None:
            raise APIError(f"'{name}' ({what}) is not supported by this server", param=name,
                           code="unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError("'modalities' other than [\"text\"] are not supported by this server",
                       param="modalities", code="unsupported_parameter")
    for name, kind in ACCEPTED.items():
        v = body.get(name)
        if v is not None and (not isinstance(v, kind) or (kind is not bool and
                                                          isinstance(v, bool))):
            raise _type_error(name, {dict: "an object", bool: "a boolean",
                                     str: "a string"}[kind], v)


def _request_template(body: dict, config: ChatConfig) -> str | None:
    """The request's own chat template; refused unless the server trusts request templates
    (vLLM's check: a `chat_template` field, or one inside chat_template_kwargs)."""
    template = get_str(body, "chat_template")
    kwargs = body.get("chat_template_kwargs")
    nested = isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
    if not config.trust_request_chat_template and (template is not None or nested):
        name = "chat_template" if template is not None else "chat_template_kwargs"
        raise APIError(f"'{name}' carries a chat template, and this server only renders its "
                       "own: start it with --trust-request-chat-template to allow request "
                       "templates", param=name, code="untrusted_chat_template")
    return check_unicode(template, "chat_template") if template else template


def parse_chat_inputs(body: dict, config: ChatConfig) -> ChatInputs:
    check_openai_fields(body)
    messages = parse_messages(body)
    tools = parse_tools(body, config.tool_call_parser)
    template = _request_template(body, config)
    kwargs = dict(get_obj(body, "chat_template_kwargs"))
    try:
        check_template_kwargs(kwargs)
    except ValueError as e:
        raise APIError(str(e), param="chat_template_kwargs", code="invalid_value") from None
    effort = get_str(body, "reasoning_effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)  # vLLM hands it to the template
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if cont and (add_gen or messages[-1]["role"] != "assistant"):
        raise APIError("continue_final_message needs add_generation_prompt false and a last "
                       "message from the assistant", param="continue_final_message",
                       code="invalid_value")
    return ChatInputs(messages, tools, kwargs, add_gen, cont, get_bool(body, "echo", False),
                      get_bool(body, "include_reasoning", True), template)


def render(tokenizer, chat: ChatInputs) -> str:
    """The prompt text (the chat template in its sandbox); a 400 when it refuses or fails."""
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions "
                       "with token ids", param="messages", code="no_chat_template")
    tools = chat.tools.tools if chat.tools is not None else None
    # a failure of the request's own template names that field; the messages otherwise
    param = "chat_template" if chat.template else "messages"
    own = {"chat_template": chat.template} if chat.template else {}
    try:
        return tokenizer.apply_chat_template(
            chat.messages, add_generation_prompt=chat.add_generation_prompt, tools=tools,
            continue_final_message=chat.continue_final_message, **own, **chat.template_kwargs)
    except (ChatTemplateError, ValueError) as e:
        raise APIError(_one_line(f"cannot apply the chat template: {e}"), param=param,
                       code="no_chat_template" if "no chat template" in str(e) else
                       "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - a tokenizer class of another kind
        raise APIError(_one_line(f"the chat template failed on these messages: "
                                 f"{type(e).__name__}: {e}"), param=param,
                       code="invalid_value") from None


def _one_line(message: str) -> str:
    """A template's error (a syntax error's source line, a raise_exception text) on one line."""
    return " ".join(message.split())
