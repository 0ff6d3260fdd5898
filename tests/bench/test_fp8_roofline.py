"""The decode floor counts FP8 weights at one byte each."""

import torch

from mambaserve.bench.one_batch import OneBatchConfig, run_one_batch
from mambaserve.bench.presets import preset_config
from mambaserve.bench.roofline import ModelCounts, decode_weight_bytes
from mambaserve.config import ModelConfig


def test_fp8_params_count_one_byte():
    raw = preset_config("tiny")
    counts, cfg = ModelCounts.of(raw), ModelConfig.from_dict(raw)
    full = decode_weight_bytes(counts, cfg, 1, torch.bfloat16)
    assert full == int(counts.decode_weights(cfg, 1) * 2)
    assert decode_weight_bytes(counts, cfg, 1, torch.bfloat16, fp8_params=1000) == full - 1000


def test_one_batch_with_on_the_fly_fp8():
    c = OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[16], output_len=3,
                       device="cpu", dtype="float32", engine={"quantization": "fp8"})
    plain = OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[16], output_len=3,
                           device="cpu", dtype="float32")
    (r,), (p,) = run_one_batch(c, log=lambda *_: None), run_one_batch(plain, log=lambda *_: None)
    assert r.fp8_params > 0 and p.fp8_params == 0
    # fp32 model: each FP8 parameter saves 3 of its 4 bytes in the floor
    assert p.decode_bytes_per_step - r.decode_bytes_per_step == 3 * r.fp8_params
