"""`mambaserve serve`'s server flags reach the launcher as they should (the launcher is replaced:
no model loads), and bad values are one-line errors."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mambaserve import cli  # noqa: E402


@pytest.fixture()
def captured(monkeypatch):
    import mambaserve.server.launcher as launcher

    seen: dict = {}

    def fake_serve(model, host, port, **kw):
        seen.update(kw, model=model, host=host, port=port)
        return 0

    monkeypatch.setattr(launcher, "serve", fake_serve)
    monkeypatch.delenv("MAMBASERVE_API_KEY", raising=False)
    return seen


def test_defaults(captured):
    assert cli.main(["serve", "--port", "0"]) == 0
    assert captured["drain_timeout"] == 60.0 and captured["api_key"] is None
    assert captured["allowed_origins"] == [] and captured["allowed_hosts"] is None
    assert captured["max_body_bytes"] == 4 << 20
    assert (captured["timeout_keep_alive_s"], captured["timeout_header_s"],
            captured["timeout_body_s"]) == (5.0, 10.0, 30.0)
    assert captured["enable_prompt_tokens_details"] is False  # cache hits stay unreported
    assert captured["trust_request_chat_template"] is False  # request templates refused


def test_flags_and_environment(captured, monkeypatch):
    monkeypatch.setenv("MAMBASERVE_API_KEY", "from-env")
    assert cli.main(["serve", "--port", "0", "--drain-timeout", "0.5", "--allowed-origins",
                     "http://a.example, http://b.example", "--allowed-hosts", "*.example.com",
                     "--max-body-mb", "0.5", "--timeout-header", "2.5"]) == 0
    assert captured["drain_timeout"] == 0.5  # a float, not rounded down
    assert captured["api_key"] == "from-env"
    assert captured["allowed_origins"] == ["http://a.example", "http://b.example"]
    assert captured["allowed_hosts"] == ["*.example.com"]
    assert captured["max_body_bytes"] == 512 << 10 and captured["timeout_header_s"] == 2.5
    assert cli.main(["serve", "--port", "0", "--api-key", "from-flag",
                     "--enable-prompt-tokens-details", "--trust-request-chat-template"]) == 0
    assert captured["api_key"] == "from-flag" and captured["enable_prompt_tokens_details"]
    assert captured["trust_request_chat_template"] is True


@pytest.mark.parametrize("flag,value", [("--drain-timeout", "-1"), ("--max-body-mb", "0"),
                                        ("--timeout-header", "nan"),
                                        ("--timeout-keep-alive", "0"),
                                        ("--timeout-body", "-3")])
def test_bad_values_are_one_line_errors(captured, capsys, flag, value):
    assert cli.main(["serve", "--port", "0", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1, err
    assert not captured  # the launcher never ran
