"""Structured output (constrained decoding): grammar compilation and per-request matchers
(grammar.py); the token mask is applied on the device by layers/logits_processors.py."""
