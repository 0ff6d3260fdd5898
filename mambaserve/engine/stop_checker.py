"""When a request is done: detokenizes its output incrementally and checks, in this order, stop
strings, EOS, stop token ids and the length limit (vLLM's order and semantics: nothing stops
before `min_tokens`; a stop string is cut from the text unless `include_stop_str_in_output`).

The text grows by what each token adds (`Tokenizer.text_stream`: constant time per token); a
request that finishes other than on a stop string (EOS, stop token, length, grammar, abort)
gets its whole output decoded once more (`final_text`, called by the scheduler's `finish`), so
its final text is exactly `decode(output_token_ids)`, an unfinished character at the end
included as the replacement character."""

from __future__ import annotations

from mambaserve.engine.request import Request
from mambaserve.engine.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)

    def check(self, req: Request) -> tuple[str, int | str | None] | None:
        """After a token was appended to `req`: (finish reason, stop reason) or None. Updates
        `req.output_text` (cut at a stop string that matched)."""
        p = req.params
        token = req.output_token_ids[-1]
        n_out = len(req.output_token_ids)
        if self.tokenizer is not None:
            prev = len(req.output_text)
            if req.text_stream is None:
                req.text_stream = self.tokenizer.text_stream(p.skip_special_tokens)
            req.output_text += req.text_stream.add(req.output_token_ids)
            if p.stop_list and n_out >= p.min_tokens:
                for stop in p.stop_list:
                    at = req.output_text.find(stop, max(0, prev - len(stop) + 1))
                    if at >= 0:
                        end = at + len(stop) if p.include_stop_str_in_output else at
                        req.output_text = req.output_text[:end]
                        return "stop", stop
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if req.prompt_len + n_out >= req.max_total_len:
            return "length", None
        return None

    def final_text(self, req: Request) -> None:
        """A request finishing other than on a stop string (the scheduler's `finish`): its text
        decoded whole, once."""
        if self.tokenizer is not None:
            req.output_text = self.tokenizer.decode(req.output_token_ids,
                                                    req.params.skip_special_tokens)
