"""FP8 checkpoints through the engine (float32, CPU: the reference FP8 path, exact by
construction): a tiny NemotronH (all four layer kinds, the MoE's shared expert quantized, its
routed experts not) and a tiny Bamba (split gate / up halves) are written by the tests in both
published layouts (tests/fp8_checkpoints.py), loaded back through `LLM`, and compared with the
unquantized model whose quantized projections run an explicit quantize -> dequantize -> float32
matmul written in the tests. Tolerance: 1e-4 on every prompt logprob; greedy tokens equal up to a
tie at that tolerance (on a GPU, float32 as well, the engine's sums run in other orders)."""

import json

import pytest
import torch
from family_checkpoints import make_tiny_bamba
from fp8_checkpoints import install_reference, write_fp8_checkpoint
from tiny_checkpoint import add_byte_tokenizer, make_tiny_checkpoint

from mambaserve import LLM, SamplingParams
from mambaserve.layers.fp8_linear import Fp8Linear
from mambaserve.models.registry import checkpoint_name_map

TOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CALIB = [_ids(40, 100 + i) for i in range(3)]
PROMPT = _ids(45, 7)


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    return torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def greedy(llm: LLM, ids: list[int], n: int = 12) -> list[int]:
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return list(llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].token_ids)


def assert_same_greedy(llm: LLM, ref: LLM, ids: list[int], n: int = 12) -> None:
    """`llm` picks the reference's greedy tokens, except from a step where the reference's two
    likeliest tokens are within 2 x TOL of each other (a tie at the tolerance; on the CPU the
    two compute the same float32 values, on a GPU their sums run in other orders)."""
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
    want = ref.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
    got = greedy(llm, ids, n)
    for i, (x, y) in enumerate(zip(got, want.token_ids)):
        if x != y:
            top = sorted(want.logprobs[i].values(), reverse=True)
            assert top[0] - top[1] <= 2 * TOL, (i, got, want.token_ids, top)
            return


@pytest.fixture(scope="module", params=["NemotronH", "Bamba"])
def source(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "NemotronH":
        return add_byte_tokenizer(make_tiny_checkpoint(root / "src", seed=3))
    return make_tiny_bamba(root / "src", seed=1)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_fp8_checkpoint_matches_the_reference_math(source, fmt, tmp_path):
    dst = tmp_path / "fp8"
    quant = write_fp8_checkpoint(source, dst, fmt, CALIB)
    llm = LLM(dst, chunked_prefill_size=16, max_num_seqs=4)
    model = llm.engine.model
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    fp8 |= {n + ".gate_up" for n, m in model.named_modules()
            if getattr(m, "gate_up_weight_scale", None) is not None}
    static = {n for n, m in model.named_modules() if getattr(m, "input_scale", None) is not None}
    # eager: its projections are replaced after loading, which CUDA graphs captured at start
    # would not see (they would replay the freed modules' weights)
    ref = LLM(source, chunked_prefill_size=16, max_num_seqs=4, enforce_eager=True)
    replaced = install_reference(ref.engine.model, checkpoint_name_map(ref.engine.model_config),
                                 quant)
    assert fp8 == set(replaced) and fp8
    assert bool(static) == (fmt == "modelopt")
    # attention, lm_head, conv and the routed experts stay in the model dtype
    for n, p in model.named_parameters():
        if any(s in n for s in ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head", "conv",
                                "experts_", "embed")):
            assert p.dtype == torch.float32, n

    got, want = prompt_logprobs(llm, PROMPT), prompt_logprobs(ref, PROMPT)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert_same_greedy(llm, ref, PROMPT)

    plain = LLM(source)
    a, b = greedy(llm, PROMPT, 24), greedy(plain, PROMPT, 24)
    drift = (got - prompt_logprobs(plain, PROMPT)).abs()
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"\n{fmt}: greedy tokens equal to the unquantized model's for {agree}/{len(a)}; "
          f"prompt logprob drift mean {drift.mean():.2e} max {drift.max():.2e}")


def test_modelopt_hf_quant_config_alone(source, tmp_path):
    """NVIDIA's older exports: config.json without quantization_config, hf_quant_config.json."""
    dst = tmp_path / "fp8"
    write_fp8_checkpoint(source, dst, "modelopt", CALIB, config_json=False)
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    llm = LLM(dst)
    assert any(isinstance(m, Fp8Linear) for m in llm.engine.model.modules())


def test_on_the_fly_equals_the_saved_compressed_tensors_checkpoint(source, tmp_path):
    """--quantization fp8 (per-channel weight scales, per-token activations) is the model a
    compressed-tensors FP8-Dynamic checkpoint of the same weights loads as."""
    dst = tmp_path / "fp8"
    write_fp8_checkpoint(source, dst, "compressed-tensors")
    online = LLM(source, quantization="fp8")
    saved = LLM(dst)
    a = dict(online.engine.model.named_parameters())
    b = dict(saved.engine.model.named_parameters())
    assert a.keys() == b.keys()
    for n, p in a.items():
        assert p.dtype == b[n].dtype and torch.equal(p, b[n]), n
    assert torch.equal(prompt_logprobs(online, PROMPT), prompt_logprobs(saved, PROMPT))


def test_prefix_caching_on_and_off_agree_with_fp8(source):
    """Same tokens with the prefix cache on and off. Logprobs: a state restored from a snapshot
    differs from the recomputed one by float32 rounding (~1e-7, within the 1e-4 the unquantized
    engine's prefix-cache tests allow), and such a difference can move an activation across an
    FP8 rounding boundary (one e4m3 step is 1/8 of its binade), which moves a logprob by up to
    ~1e-2 here: the bound is 5e-2, the exactness of the prefix cache itself is tested unquantized
    (tests/engine/test_prefix_cache.py)."""
    kw = dict(quantization="fp8", chunked_prefill_size=16, max_num_seqs=4)
    on = LLM(source, enable_prefix_caching=True, **kw)
    off = LLM(source, **kw)
    shared = _ids(40, 11)
    prompts = [{"prompt_token_ids": shared + _ids(5 + i, 20 + i)} for i in range(4)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for _ in range(2):  # the second round hits the cache
        got, want = on.generate(prompts, sp), off.generate(prompts, sp)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            lg = [d[t] for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
            lw = [d[t] for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
            torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=0, atol=5e-2)
    assert on.engine.cache_stats()["hit_tokens"] > 0


FP8_INPUT_FLAGS = ("fp8_input", "fp8_mixer_input", "fp8_ffn_input")


def test_norms_write_the_fp8_rows_of_dynamic_projections(source):
    """With dynamic activation scales, each block whose first projection is FP8 takes its input
    from the norm as FP8 rows (quantized in the norm's pass; the MLP's down projection from the
    activation's) and computes what quantizing inside the projection computes: identical
    logprobs with that routing switched off."""
    llm = LLM(source, quantization="fp8", chunked_prefill_size=16)
    model = llm.engine.model
    flags = [(layer, f) for layer in model.layers for f in FP8_INPUT_FLAGS
             if getattr(layer, f, False)]
    kinds = {type(getattr(layer, "mixer", None) or (
        layer.mamba if f == "fp8_mixer_input" else layer.feed_forward)).__name__
             for layer, f in flags}
    assert {"Mamba2Mixer"} < kinds, kinds  # Mamba and the dense MLP of each family
    routed = prompt_logprobs(llm, PROMPT)
    for layer, f in flags:
        setattr(layer, f, False)
    torch.testing.assert_close(prompt_logprobs(llm, PROMPT), routed, rtol=0, atol=0)


def test_exclusions_can_be_overridden(source):
    llm = LLM(source, quantization="fp8", quantization_exclude="lm_head")
    names = {n for n, m in llm.engine.model.named_modules() if isinstance(m, Fp8Linear)}
    assert any(n.endswith(("q_proj", "o_proj")) for n in names)
    assert "lm_head" not in names
    everything = LLM(source, quantization="fp8", quantization_exclude="")
    assert isinstance(everything.engine.model.lm_head, Fp8Linear)


@pytest.mark.parametrize("how", ["online", "modelopt"])
def test_zero_host_syncs_with_fp8(source, how, tmp_path):
    from mambaserve.config import EngineConfig
    from mambaserve.engine.llm_engine import LLMEngine
    from mambaserve.tools.audit_scenarios import format_report, run_scenarios

    path, kw = source, {"quantization": "fp8"}
    if how == "modelopt":  # static input scales
        path, kw = tmp_path / "fp8", {}
        write_fp8_checkpoint(source, path, "modelopt", CALIB)
    engine = LLMEngine(path, EngineConfig(chunked_prefill_size=16, max_num_seqs=4, **kw))
    assert any(isinstance(m, Fp8Linear) for m in engine.model.modules())
    results = run_scenarios(engine)
    for r in results.values():
        assert r.forwards > 0 and r.forward_syncs == 0 and r.sampler_syncs == 0, \
            format_report(results)


def _rewrite_quant(path, update):
    cfg = json.loads((path / "config.json").read_text())
    update(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt,update,message", [
    ("modelopt", lambda q: q["quantization"].update(quant_algo="NVFP4"),
     "unsupported ModelOpt quant_algo 'NVFP4'"),
    ("modelopt", lambda q: q.update(quant_method="awq"), "unsupported quantization method 'awq'"),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"].update(input_activations=None),
     "weight-only FP8"),
    ("compressed-tensors", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4),
     "must be 8-bit float"),
])
def test_unsupported_quantization_configs_fail_clearly(source, tmp_path, fmt, update, message):
    dst = tmp_path / "fp8"
    write_fp8_checkpoint(source, dst, fmt, CALIB)
    _rewrite_quant(dst, update)
    with pytest.raises(ValueError, match=message) as err:
        LLM(dst)
    assert "\n" not in str(err.value)


def test_unknown_online_quantization_is_refused(source):
    with pytest.raises(ValueError, match="quantization must be fp8 or unset"):
        LLM(source, quantization="int4")
