"""The two backends `bench one-batch` times (bench/one_batch.py): the engine in-process, and the
transformers class of the checkpoint's architecture. Each `run(b, n, out_len, seed)` returns the
seconds until every prompt of the batch has its first token and the decode step times after
that; `random_prompts` draws the token ids both use, `prefill_untimed` runs a follow-up turn's
histories. A backend is built from the benchmark's
`OneBatchConfig` (`c`: batch sizes, input lengths, dtype, device, engine settings)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mambaserve.bench.roofline import sync


def random_prompts(cfg_vocab: int, b: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg_vocab, (b, n), generator=g).tolist()


def prefill_untimed(eng, prompts: list[list[int]], tag: str) -> None:
    """Run `prompts` through the engine `eng` to their first token, untimed: with the prefix
    cache on, the histories a follow-up turn then hits (request ids `tag`-0, `tag`-1, ...)."""
    from mambaserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    while eng.has_unfinished_requests():
        eng.step()


class MambaserveBackend:
    def __init__(self, path: Path, c, load_format: str) -> None:
        from mambaserve.config import EngineConfig
        from mambaserve.engine.llm_engine import LLMEngine

        P = self.prefix_len = c.cached_prefix_len
        whole = max(b * (P + n) for b in c.batch_sizes for n in c.input_lens)  # largest batch
        kw = {"dtype": c.dtype, "device": c.device, "max_num_seqs": max(c.batch_sizes),
              "chunked_prefill_size": whole,
              "max_model_len": P + max(c.input_lens) + c.output_len + 16,
              **({"enable_prefix_caching": True} if P else {}),
              "load_format": load_format, "seed": c.seed,
              # per-step timings of one batch without run-ahead unless --engine turns it on
              # (then a step's time is the interval between its outputs, as a stream sees it)
              "async_scheduling": False,
              # the whole batch prefills at full speed: no cap for decodes already running
              # (rows that start decoding early would otherwise finish before the last one
              # prefills, and the decode steps measured would be of a smaller batch)
              "max_step_prefill_tokens": whole, "steady_step_prefill_tokens": whole,
              **c.engine}
        t0 = time.perf_counter()
        self.engine = LLMEngine(path, EngineConfig(**kw))
        self.load_s = time.perf_counter() - t0
        self.device = self.engine.device
        self.cfg = self.engine.model_config
        self.fp8_params = sum(p.numel() for p in self.engine.model.parameters()
                              if p.dtype == torch.float8_e4m3fn)
        self.counter = 0
        self.temperature, self.top_p = c.temperature, c.top_p
        self.cached_tokens: list[int] = []  # per prompt of the last run: tokens the cache served

    def _submit(self, prompts: list[list[int]], p) -> None:
        for prompt in prompts:
            self.counter += 1
            self.engine.add_request(f"r{self.counter}", {"prompt_token_ids": prompt}, p)

    def run(self, b: int, n: int, out_len: int, seed: int) -> tuple[float, list[float]]:
        """(seconds until every prompt has its first token, decode step times after that)."""
        from mambaserve.engine.sampling_params import SamplingParams

        eng = self.engine
        prompts = random_prompts(self.cfg.vocab_size, b, n, seed)
        if self.prefix_len:  # the earlier turn, untimed: its prefix state goes into the cache
            # a history of its own per prompt length (no earlier run's suffix is cached)
            prefixes = random_prompts(self.cfg.vocab_size, b, self.prefix_len,
                                      seed + 7919 + 31 * n)
            self.counter += 1
            prefill_untimed(eng, prefixes, f"h{self.counter}")
            prompts = [a + q for a, q in zip(prefixes, prompts)]
        self._submit(prompts, SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                             max_tokens=out_len, ignore_eos=True, seed=seed))
        cached: dict[str, int] = {}
        started: set[str] = set()
        prefill, steps = 0.0, []
        overlap = eng.async_scheduling  # no device sync between steps: the host runs ahead
        sync(self.device)
        while eng.has_unfinished_requests():
            if not overlap:
                sync(self.device)
            t = time.perf_counter()
            outs = eng.step()
            if not overlap:
                sync(self.device)
            dt = time.perf_counter() - t
            for o in outs:
                cached.setdefault(o.request_id, o.num_cached_tokens)
            if len(started) < b:
                prefill += dt
                started.update(o.request_id for o in outs if o.outputs[0].token_ids)
            else:
                steps.append(dt)
        self.cached_tokens = list(cached.values())
        return prefill, steps


class HFBackend:
    def __init__(self, path: Path, c, load_format: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from mambaserve.config import ModelConfig, resolve_dtype

        self.cfg = ModelConfig.from_hf(path)
        self.device = torch.device(c.device)
        dtype = resolve_dtype(c.dtype, self.cfg, self.device.type)
        t0 = time.perf_counter()
        if load_format == "dummy":  # transformers' own random init, on the device
            hf_cfg = AutoConfig.from_pretrained(path)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device)
        self.architecture = type(model).__name__
        self.model = model.eval()
        self.load_s = time.perf_counter() - t0

    def run(self, b: int, n: int, out_len: int, seed: int) -> tuple[float, list[float]]:
        from transformers import LogitsProcessor, LogitsProcessorList

        device = self.device

        class Stamp(LogitsProcessor):
            def __init__(self) -> None:
                self.t: list[float] = []

            def __call__(self, input_ids, scores):
                sync(device)
                self.t.append(time.perf_counter())
                return scores

        ids = torch.tensor(random_prompts(self.cfg.vocab_size, b, n, seed), device=device)
        with torch.inference_mode():
            sync(device)
            t = time.perf_counter()
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)  # one prefill forward
            sync(device)
            prefill = time.perf_counter() - t
            if out_len == 1:
                return prefill, []
            stamp = Stamp()
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                min_new_tokens=out_len, do_sample=False,
                                logits_processor=LogitsProcessorList([stamp]),
                                pad_token_id=self.cfg.pad_token_id or 0)
        return prefill, [b2 - a for a, b2 in zip(stamp.t, stamp.t[1:])]
