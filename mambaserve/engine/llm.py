"""The offline Python API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from mambaserve.config import EngineConfig
from mambaserve.engine.chat_content import (
    ContentPartError,
    check_template_kwargs,
    join_text_parts,
)
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.outputs import RequestOutput
from mambaserve.engine.prompt import prompt_cache_salt
from mambaserve.engine.request_queue import check_priority
from mambaserve.engine.sampling_params import SamplingParams


class LLM:
    """Load a hybrid Mamba2 checkpoint and generate.

    `model`: a checkpoint folder in Hugging Face format (config.json, safetensors, tokenizer.json);
    None takes the embedded default model. Engine settings are keyword arguments named like the
    fields of `EngineConfig` (dtype, device, max_num_seqs, chunked_prefill_size,
    tensor_parallel_size, ...). With tensor_parallel_size N > 1, N - 1 worker processes run
    beside this one until `close()` (or the end of a `with LLM(...) as llm:` block).
    """

    def __init__(self, model: str | Path | None = None, **engine_kwargs) -> None:
        if model is None:
            from mambaserve.default_model import default_model_path

            model = default_model_path()
        unknown = set(engine_kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {sorted(unknown)}; known: "
                             f"{sorted(EngineConfig.__dataclass_fields__)}")
        self.engine = LLMEngine(model, EngineConfig(**engine_kwargs))
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes (nothing to do at one rank)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a token-id list, a {"prompt_token_ids": [...]} or {"prompt": "..."}
        dict (either may add "cache_salt": a non-empty string; the prefix cache shares entries
        only between prompts of the same salt, as vLLM's), or a list of them. `priority`: as
        vLLM's, one integer per prompt, lower served first (None: 0 for every prompt; other
        values need scheduling_policy="priority"). Returns one RequestOutput per prompt, in
        order. All prompts are validated before any is queued."""
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            got = f"{len(priority)} values" if isinstance(priority, (list, tuple)) else \
                repr(priority)[:80]
            raise ValueError(f"priority must be a list of one integer per prompt "
                             f"({len(prompts)} prompts), got {got}")
        for p in priority:
            check_priority(p, self.engine.config.scheduling_policy)
        # validate everything first: a bad prompt queues nothing (and strings are tokenized once)
        checked = []
        for p, sp in zip(prompts, params):
            if isinstance(sp, SamplingParams):
                sp.validate()
            truncate = sp.truncate_prompt_tokens if isinstance(sp, SamplingParams) else None
            text, token_ids = self.engine.validate_prompt(p, truncate)
            checked.append({"prompt": text, "prompt_token_ids": token_ids,
                            "cache_salt": prompt_cache_salt(p)})
        ids: list[str] = []
        try:
            for p, sp, prio in zip(checked, params, priority):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, p, sp, priority=prio)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # a refused prompt leaves nothing of this call queued
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template and generate; the arguments are
        vLLM's. `chat_template`: a Jinja template source rendered instead of the model's own
        (None or "": the model's). `chat_template_kwargs`: extra template variables (not the
        reserved names the server refuses). `add_generation_prompt`: end with the assistant's
        header; `continue_final_message` (needs add_generation_prompt=False): leave the last
        message open for the model to continue. `tools`: tool definitions for the template.
        A message's content may be a list of text parts, joined a line apart as the server
        joins them."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: pass add_generation_prompt=False to continue the last message")
        kwargs = dict(chat_template_kwargs or {})
        check_template_kwargs(kwargs)
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        texts = [tok.apply_chat_template(
            [_with_text_content(m) for m in c], add_generation_prompt=add_generation_prompt,
            tools=tools, continue_final_message=continue_final_message,
            chat_template=chat_template, **kwargs) for c in convs]
        # the template writes the special tokens itself: no BOS added to it
        return self.generate([{"prompt": t, "prompt_token_ids": tok.encode(
            t, add_special_tokens=False)} for t in texts], sampling_params)


def _with_text_content(message: dict) -> dict:
    """The message with list-of-parts content joined into one string (as the server does)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    try:
        return {**message, "content": join_text_parts(content)}
    except ContentPartError as e:
        raise ValueError(f"content[{e.index}]: {e}") from None
