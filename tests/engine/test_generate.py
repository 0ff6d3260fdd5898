"""End-to-end generation through LLM against transformers' generate (greedy, float32)."""

import pytest
import torch

from mambaserve import LLM, SamplingParams


def rand_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_batch_matches_hf_with_chunked_and_mixed_batches(tiny_ckpt, hf_model):
    llm = LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=3)
    prompts = rand_prompts([5, 19, 41, 12, 3])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    stats = llm.engine.stats
    assert stats["chunked_prefills"] > 0, stats
    assert stats["mixed_steps"] > 0, stats
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 32)
        assert o.outputs[0].finish_reason == "length"
        assert o.prompt_token_ids == p


def test_sampled_logprobs_match_hf(tiny_llm, hf_model):
    p = rand_prompts([9], seed=4)[0]
    out = tiny_llm.generate({"prompt_token_ids": p}, SamplingParams(
        temperature=0.9, seed=7, max_tokens=6, logprobs=3, ignore_eos=True))[0].outputs[0]
    ids = p + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(p) - 1 + i]
        assert abs(d[tok] - row[tok].item()) < 1e-4
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(d) and len(d) in (3, 4)
    assert abs(out.cumulative_logprob - sum(d[t] for d, t in zip(out.logprobs, out.token_ids))) \
        < 1e-5


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    p = {"prompt_token_ids": rand_prompts([10], seed=5)[0]}
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=12,
                        ignore_eos=True)
    alone = tiny_llm.generate(p, sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in rand_prompts([4, 17, 8], seed=6)]
    mixed = tiny_llm.generate(others[:2] + [p] + others[2:],
                              [SamplingParams(temperature=1.0, max_tokens=9)] * 2 + [sp]
                              + [SamplingParams(temperature=0.5, max_tokens=3)])
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate(p, SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                     seed=124, max_tokens=12, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_completions_differ(tiny_llm):
    out = tiny_llm.generate("to be", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                     ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_max_tokens_and_stop_strings(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompt = "The quick brown fox"
    base = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 20 and base.finish_reason == "length"
    assert base.text == tok.decode(base.token_ids)
    stop = base.text[5:8]
    assert stop and base.text.find(stop) == 5
    out = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                   ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:5]
    assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.token_ids) < 20
    kept = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                    include_stop_str_in_output=True,
                                                    ignore_eos=True))[0].outputs[0]
    assert kept.text == base.text[:8]


def test_stop_token_ids_and_eos(tiny_llm):
    p = {"prompt_token_ids": rand_prompts([6], seed=9)[0]}
    base = tiny_llm.generate(p, SamplingParams(temperature=0, max_tokens=10,
                                               ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = tiny_llm.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)


def test_prompt_logprobs_with_top_alternatives(tiny_llm, hf_model):
    ids = rand_prompts([13], seed=2)[0]
    out = tiny_llm.generate({"prompt_token_ids": ids},
                            SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        d = out.prompt_logprobs[i]
        assert abs(d[ids[i]] - ref[i - 1, ids[i]].item()) < 1e-4
        for t in torch.topk(ref[i - 1], 2).indices.tolist():
            assert abs(d[t] - ref[i - 1, t].item()) < 1e-4


def test_prompt_logprob_ranks_are_vocabulary_ranks(tiny_llm, hf_model):
    """Each prompt token's rank (RequestOutput.prompt_logprob_ranks) is the number of vocabulary
    entries at least as likely as it under a reference forward, across prefill chunks."""
    ids = rand_prompts([40], seed=5)[0]  # two chunks of tiny_llm's 24-token budget
    out = tiny_llm.generate({"prompt_token_ids": ids},
                            SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    ranks = out.prompt_logprob_ranks
    assert len(ranks) == len(ids) and ranks[0] is None
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]  # unchanged
    for i in range(1, len(ids)):
        row, lp = ref[i - 1], ref[i - 1, ids[i]]
        # the brute-force rank, up to float rounding between the two forwards
        lo, hi = int((row > lp + 1e-4).sum()) + 1, int((row >= lp - 1e-4).sum())
        assert lo <= ranks[i] <= hi, (i, ranks[i], lo, hi)
    assert max(ranks[1:]) > 20 and min(ranks[1:]) >= 1  # random tokens: far from the top


def test_logprobs_zero_returns_only_the_sampled_token(tiny_llm):
    p = {"prompt_token_ids": rand_prompts([6], seed=11)[0]}
    out = tiny_llm.generate(p, SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=0,
                                              ignore_eos=True))[0].outputs[0]
    assert [list(d) for d in out.logprobs] == [[t] for t in out.token_ids]


def test_chat_uses_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt == "<s>user: hi\n<s>assistant: "


def test_chat_takes_a_template_of_its_own(tiny_llm):
    """`chat_template` (vLLM's LLM.chat argument) is rendered instead of the model's."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }};{% endfor %}"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1),
                        chat_template=template)[0]
    expected = "[system] be brief;[user] hi;"
    assert out.prompt == expected
    tok = tiny_llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    default = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1))[0]
    assert default.prompt_token_ids != out.prompt_token_ids  # the model's template otherwise


CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }};{% endfor %}"
                 "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }};"
                 "{% endif %}{% if style %}style={{ style }};{% endif %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.parametrize("kwargs, msgs, expected", [
    ({}, [{"role": "user", "content": "hi"}], "[user] hi;[assistant] "),
    ({"chat_template_kwargs": {"style": "terse"}}, [{"role": "user", "content": "hi"}],
     "[user] hi;style=terse;[assistant] "),
    ({"add_generation_prompt": False}, [{"role": "user", "content": "hi"}], "[user] hi;"),
    ({"add_generation_prompt": False, "continue_final_message": True},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}],
     "[user] hi;[assistant] Well"),
    ({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]},
     [{"role": "user", "content": "hi"}], "[user] hi;tools=get_time;[assistant] "),
    ({}, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "input_text", "text": "b"},
                                       {"type": "refusal", "refusal": "c"}]}],
     "[user] a\nb\nc;[assistant] "),
])
def test_chat_takes_vllm_template_options(tiny_llm, kwargs, msgs, expected):
    """chat_template_kwargs, add_generation_prompt, continue_final_message and tools (vLLM's
    LLM.chat arguments) reach the template; content parts are joined as the server joins them."""
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1),
                        chat_template=CHAT_TEMPLATE, **kwargs)[0]
    assert out.prompt == expected
    tok = tiny_llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("kwargs, msgs, match", [
    ({"chat_template_kwargs": {"messages": []}}, None, "may not set 'messages'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, None,
     "may not set 'add_generation_prompt'"),
    ({"continue_final_message": True}, None, "cannot both be true"),
    ({}, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"content\[0\]: only text parts"),
])
def test_chat_refuses_bad_template_options(tiny_llm, kwargs, msgs, match):
    msgs = msgs or [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=match):
        tiny_llm.chat(msgs, SamplingParams(max_tokens=1), **kwargs)
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty prompt"),
    ({"prompt_token_ids": [1, 320]}, SamplingParams(), r"token id 320 is outside the vocab"),
    ({"prompt_token_ids": [1, -1]}, SamplingParams(), r"token id -1 is outside the vocab"),
    ({"prompt_token_ids": [1, 2.5]}, SamplingParams(), r"token id 2.5 is outside the vocab"),
    ({"text": "x"}, SamplingParams(), "prompt_token_ids"),
    (42, SamplingParams(), "a prompt is a string"),
    ({"prompt_token_ids": [5] * 5000}, SamplingParams(), "model's limit"),
])
def test_bad_prompts_raise_clear_errors(tiny_llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate(prompt, params)
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n must be"),
    ({"logprobs": 50}, "logprobs"),
    ({"temperature": float("nan")}, "temperature must be a finite"),
    ({"temperature": float("inf")}, "temperature must be a finite"),
    ({"top_k": 2**40}, "below 2\\*\\*31"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_checkpoint_paths(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="malformed config.json"):
        LLM(tmp_path)
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(tmp_path, max_batch=3)
