"""Chat templates ship with checkpoints: they render in jinja2's immutable sandbox, with the
helpers Hugging Face templates use, and a hostile template executes nothing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_checkpoint import add_byte_tokenizer  # noqa: E402

from mambaserve.engine.tokenizer import ChatTemplateError, Tokenizer  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]


def _tokenizer(tmp_path: Path, template: str) -> Tokenizer:
    add_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("template", [
    # the template from the issue, made to leave a trace if it ran
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ 'x' }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
])
def test_hostile_template_executes_nothing(tmp_path, template):
    marker = tmp_path / "MARKER"
    tok = _tokenizer(tmp_path, template.replace("MARKER", str(marker)))
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(MSGS)
    assert not marker.exists()
    assert "chat template" in str(e.value)
    assert "\n" not in str(e.value)  # one line


def test_the_issues_template_names_the_sandbox(tmp_path):
    tok = _tokenizer(tmp_path, "{{ cycler.__init__.__globals__.os.popen('id').read() }}")
    with pytest.raises(ChatTemplateError, match=r"sandbox forbids.*unsafe"):
        tok.apply_chat_template(MSGS)


def test_messages_cannot_be_mutated_and_range_is_capped(tmp_path):
    tok = _tokenizer(tmp_path, "{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}")
    msgs = [dict(m) for m in MSGS]
    with pytest.raises(ChatTemplateError, match="sandbox"):
        tok.apply_chat_template(msgs)
    assert msgs == MSGS
    tok = _tokenizer(tmp_path, "{% for i in range(10**9) %}x{% endfor %}")
    with pytest.raises(ChatTemplateError, match="range"):
        tok.apply_chat_template(MSGS)


def test_hf_helpers(tmp_path):
    tok = _tokenizer(
        tmp_path,
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' "
        "+ m.role) }}{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson(indent=2) }}|{% endfor %}{{ strftime_now('%Y') }}")
    msgs = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "skipped by break"}]
    out = tok.apply_chat_template(msgs)
    parts = out.split("|")
    # tojson like Hugging Face's: indent honoured, no HTML escaping, non-ASCII kept
    assert parts[0] == json.dumps(msgs[0], indent=2, ensure_ascii=False)
    assert json.loads(parts[1]) == msgs[1] and "skipped" not in out
    assert re.fullmatch(r"\d{4}", parts[2])
    with pytest.raises(ChatTemplateError, match="^no tools: tool$"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_broken_and_missing_templates_are_clear(tmp_path):
    tok = _tokenizer(tmp_path, "{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(MSGS)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MSGS)


def test_demo_template_roles(tmp_path):
    """The demo model's template takes system, user and assistant and refuses other roles
    (docs/server.md says so)."""
    from mambaserve.default_model import default_model_path

    tok = Tokenizer(default_model_path())
    for role in ("system", "user", "assistant"):
        assert f"<|{role}|>" in tok.apply_chat_template([{"role": role, "content": "x"}])
    for role in ("developer", "tool"):
        with pytest.raises(ChatTemplateError, match=f"Unknown role: {role}"):
            tok.apply_chat_template([{"role": role, "content": "x"}])


def test_encode_matches_the_plain_encoder(tmp_path):
    from mambaserve.default_model import default_model_path

    tok = Tokenizer(default_model_path())
    text = "ROMEO: But soft, what light through yonder window breaks? é 字 \n\n  x"
    assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids
