import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve.models.loader import load_model


def test_loads_every_parameter_like_hf(tiny_ckpt, hf_model):
    model = load_model(tiny_ckpt, torch.float32, "cpu")
    hf = dict(hf_model.named_parameters())
    assert torch.equal(model.embeddings.weight, hf["model.embeddings.weight"])
    assert torch.equal(model.layers[0].mixer.conv_weight,
                       hf["model.layers.0.mixer.conv1d.weight"].squeeze(1))
    assert torch.equal(model.layers[1].mixer.experts_up[3],
                       hf["model.layers.1.mixer.experts.up_proj"][3])
    assert torch.equal(model.layers[1].mixer.gate.e_score_correction_bias,
                       dict(hf_model.named_buffers())[
                           "model.layers.1.mixer.gate.e_score_correction_bias"])
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"])


def test_dtype_conversion_keeps_router_fp32(tiny_ckpt):
    model = load_model(tiny_ckpt, torch.bfloat16, "cpu")
    assert model.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    assert model.layers[1].mixer.gate.weight.dtype == torch.float32


def test_sharded_checkpoint(tmp_path, tiny_ckpt):
    from tiny_checkpoint import load_hf

    hf = load_hf(tiny_ckpt)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a = load_model(tmp_path, torch.float32, "cpu")
    b = load_model(tiny_ckpt, torch.float32, "cpu")
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    # transformers saves lm_head even when tie_word_embeddings is set: it is then used as saved
    untied = load_model(path, torch.float32, "cpu")
    assert torch.equal(untied.lm_head.weight, tensors["lm_head.weight"])
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, torch.float32, "cpu")
    assert model.lm_head.weight.data_ptr() == model.embeddings.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, tensors["backbone.embeddings.weight"])


def _edit(tmp_path, tiny_ckpt, fn):
    dst = tmp_path / "edited"
    shutil.copytree(tiny_ckpt, dst)
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_error(tmp_path, tiny_ckpt):
    path = _edit(tmp_path, tiny_ckpt, lambda t: t.pop("backbone.layers.2.mixer.A_log"))
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.2.mixer.A_log'\]"):
        load_model(path, torch.float32, "cpu")


def test_missing_expert_error(tmp_path, tiny_ckpt):
    path = _edit(tmp_path, tiny_ckpt,
                 lambda t: t.pop("backbone.layers.1.mixer.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"experts_up \(experts \[2\]\)"):
        load_model(path, torch.float32, "cpu")


def test_unexpected_tensor_error(tmp_path, tiny_ckpt):
    path = _edit(tmp_path, tiny_ckpt,
                 lambda t: t.__setitem__("backbone.layers.0.mixer.bogus", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensors: .*bogus"):
        load_model(path, torch.float32, "cpu")


def test_misshaped_tensor_error(tmp_path, tiny_ckpt):
    path = _edit(tmp_path, tiny_ckpt,
                 lambda t: t.__setitem__("backbone.norm_f.weight", torch.zeros(7)))
    with pytest.raises(ValueError, match=r"mis-shaped tensors: .*norm_f.weight: checkpoint \(7,\)"):
        load_model(path, torch.float32, "cpu")


def test_missing_weights_and_corrupt_file(tmp_path, tiny_ckpt):
    dst = tmp_path / "noweights"
    dst.mkdir()
    shutil.copy(tiny_ckpt / "config.json", dst)
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(dst, torch.float32, "cpu")
    (dst / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read checkpoint file"):
        load_model(dst, torch.float32, "cpu")
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="shards listed .* are missing"):
        load_model(dst, torch.float32, "cpu")


def test_dummy_load_format_draws_random_weights_from_the_config_alone(tmp_path, tiny_ckpt):
    """load_format="dummy" needs only config.json: every parameter is drawn on the device
    (seeded, finite, in the model's dtypes; A and dt_bias in their trained ranges)."""
    import shutil

    from mambaserve.models.random_weights import init_random_

    folder = tmp_path / "cfg"
    folder.mkdir()
    shutil.copy(tiny_ckpt / "config.json", folder / "config.json")
    with pytest.raises(ValueError, match="no safetensors"):
        load_model(folder, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(folder, torch.float32, "cpu", load_format="npz")
    a = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", seed=3)
    b = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", seed=3)
    c = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert set(pa) == set(dict(load_model(tiny_ckpt, torch.float32, "cpu").named_parameters()))
    for name, p in pa.items():
        assert torch.isfinite(p.float()).all(), name
        assert torch.equal(p, pb[name]), name
        assert p.dtype == (torch.float32 if name.endswith("gate.weight") else torch.bfloat16)
        if name.endswith("A_log"):
            assert (p.float().exp() >= 0.99).all() and (p.float().exp() <= 16.1).all()
        if name.endswith("dt_bias"):
            dt = torch.nn.functional.softplus(p.float())
            assert (dt > 0.9e-3).all() and (dt < 0.11).all()
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    ids = torch.arange(5)
    assert init_random_(a, 3, seed=0) is a and torch.isfinite(a.embeddings(ids).float()).all()


@pytest.mark.parametrize("family", ["nemotron_h_moe", "falcon_h1", "granite_moe_hybrid"])
def test_dummy_weights_under_tensor_parallelism_are_drawn_per_shard(tmp_path, family):
    """Random weights for rank 1 of 2: the model is folded and sharded on the meta device, then
    only the shard is materialized and drawn (per-rank seed). The parameters have the names,
    shapes and dtypes of the whole model loaded then sharded, are finite, and the multipliers
    are folded as on that path; the MoE router's correction bias (a buffer) is zero."""
    import shutil

    from family_checkpoints import make_tiny_falcon_h1, make_tiny_granite_moe_hybrid
    from tiny_checkpoint import make_tiny_checkpoint

    from mambaserve.distributed.group import TPGroup

    make = {"nemotron_h_moe": lambda p: make_tiny_checkpoint(p, layers=["mamba", "moe"]),
            "falcon_h1": make_tiny_falcon_h1,
            "granite_moe_hybrid": make_tiny_granite_moe_hybrid}[family]
    ckpt = make(tmp_path / "ck")
    folder = tmp_path / "cfg"
    folder.mkdir()
    shutil.copy(ckpt / "config.json", folder / "config.json")
    tp = TPGroup(1, 2)
    torch.full((1 << 20,), float("nan")).sum()  # leave NaNs in freed memory for empty tensors
    shard = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", seed=3, tp=tp)
    whole = load_model(ckpt, torch.bfloat16, "cpu", tp=tp)
    ps, pw = dict(shard.named_parameters()), dict(whole.named_parameters())
    assert {n: (p.shape, p.dtype) for n, p in ps.items()} == {
        n: (p.shape, p.dtype) for n, p in pw.items()}
    for name, p in ps.items():
        assert p.device.type == "cpu" and torch.isfinite(p.float()).all(), name
    for name, b in shard.named_buffers():
        assert torch.equal(b, torch.zeros_like(b)), name
    if hasattr(whole, "multipliers"):
        assert shard.multipliers == whole.multipliers  # folded on both paths
    other = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", seed=3,
                       tp=TPGroup(0, 2))
    assert not torch.equal(other.lm_head.weight, shard.lm_head.weight)  # each rank its own draw


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1", "granite_moe_hybrid", "bamba"])
def test_checkpoint_under_tensor_parallelism_loads_layer_by_layer(tmp_path, family,
                                                                  monkeypatch):
    """At two ranks a checkpoint is loaded, folded and sharded one decoder layer at a time: each
    rank's parameters are bit for bit those of the whole model loaded, then sharded (tied heads
    tied, multipliers folded), and no two layers were whole at once (when a layer is sharded,
    every later layer is still on the meta device)."""
    from family_checkpoints import (
        make_tiny_bamba,
        make_tiny_falcon_h1,
        make_tiny_granite_moe_hybrid,
    )
    from tiny_checkpoint import make_tiny_checkpoint

    import mambaserve.models.loader as loader
    from mambaserve.distributed.group import TPGroup
    from mambaserve.distributed.sharding import shard_layer, shard_model

    built, later_on_meta = [], []
    model_class = loader.model_class

    def recording_class(cfg):
        def build(c):
            built[:] = [model_class(cfg)(c)]
            return built[0]
        return build

    def checked_shard(layer, tp):
        layers = list(built[0].layers)
        later = layers[layers.index(layer) + 1:]
        later_on_meta.append(all(p.is_meta for m in later for p in m.parameters()))
        shard_layer(layer, tp)

    monkeypatch.setattr(loader, "model_class", recording_class)
    monkeypatch.setattr(loader, "shard_layer", checked_shard)
    make = {"nemotron_h": make_tiny_checkpoint, "falcon_h1": make_tiny_falcon_h1,
            "granite_moe_hybrid": make_tiny_granite_moe_hybrid, "bamba": make_tiny_bamba}[family]
    ckpt = make(tmp_path / "ck")

    def tied(model):
        embed = model.embed_tokens if hasattr(model, "embed_tokens") else model.embeddings
        return model.lm_head.weight is embed.weight

    for rank in (0, 1):
        tp = TPGroup(rank, 2)
        got = load_model(ckpt, torch.float32, "cpu", tp=tp)
        want = shard_model(load_model(ckpt, torch.float32, "cpu"), tp)
        pg = dict(got.named_parameters(remove_duplicate=False))
        pw = dict(want.named_parameters(remove_duplicate=False))
        assert pg.keys() == pw.keys()
        for name, p in pw.items():
            assert torch.equal(pg[name], p), (rank, name)
        assert tied(got) == tied(want)
        if hasattr(want, "multipliers"):
            assert got.multipliers == want.multipliers
    assert len(later_on_meta) == 2 * len(got.layers) and all(later_on_meta)


def test_checkpoint_problems_under_tensor_parallelism_name_every_tensor(tmp_path, tiny_ckpt):
    """The layer-by-layer load reports what the whole load does: a missing layer tensor, an
    unexpected one, one of the wrong shape, in one error."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mambaserve.distributed.group import TPGroup

    dst = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, dst)
    sd = load_file(dst / "model.safetensors")
    dropped = next(k for k in sd if ".layers.2." in k and k.endswith("in_proj.weight"))
    del sd[dropped]
    sd["backbone.layers.0.mixer.surprise"] = torch.zeros(3)
    norm = next(k for k in sd if k.endswith("norm_f.weight"))
    sd[norm] = torch.zeros(7)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    for tp in (None, TPGroup(1, 2)):
        with pytest.raises(ValueError) as err:
            load_model(dst, torch.float32, "cpu", tp=tp)
        msg = str(err.value)
        assert "layers.2.mixer.in_proj.weight" in msg and "surprise" in msg, msg
        assert "norm_f.weight: checkpoint (7,)" in msg, msg
