"""Load an HF-format checkpoint folder (config.json + safetensors, single file or sharded) into
our model: build it on the meta device, materialize it on the target device in the target dtype,
then copy every checkpoint tensor into its parameter, checking names and shapes; under tensor
parallelism, shard it for the rank. Random weights (`load_format="dummy"`) under tensor
parallelism are drawn for the rank's shard only: the model is folded and sharded on the meta
device first, so no rank ever holds the whole model (a preset larger than one GPU loads)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.sharding import shard_layer, shard_model, shard_vocab
from mambaserve.models.hybrid import RESHAPEABLE
from mambaserve.models.quantization import (
    KV_SCALE_SUFFIXES,
    ONLINE_QUANTIZATIONS,
    SCALE_SUFFIXES,
    exclude_patterns,
    fp8_weight_modules,
    quantize_model_fp8,
    read_checkpoint_quantization,
)
from mambaserve.models.random_weights import init_random_
from mambaserve.models.registry import checkpoint_name_map, model_class

LOAD_FORMATS = ("auto", "dummy")
PROGRESS_BAR_MIN_BYTES = 256 * 2**20
_IGNORED_PREFIXES = ("mtp.",)  # multi-token-prediction heads: not used for serving
_FLOAT32_PARAMS = ("gate.weight", "gate.e_score_correction_bias")  # kept fp32, like transformers


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"malformed {index}: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"checkpoint shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(f"no safetensors weights in {path} (expected model.safetensors or "
                     "model.safetensors.index.json)")


def load_model(path: str | Path, dtype: torch.dtype, device: str | torch.device,
               cfg: ModelConfig | None = None, load_format: str = "auto",
               seed: int = 0, quantization: str | None = None,
               quantization_exclude: str | None = None,
               fold_multipliers: bool = True, tp: TPGroup | None = None) -> torch.nn.Module:
    """`load_format="auto"` reads the safetensors weights; `"dummy"` needs only config.json and
    draws random weights on the device (models/random_weights.py), for benchmarks at real
    shapes without a checkpoint. An FP8 checkpoint (models/quantization.py) loads its FP8
    modules as such; `quantization="fp8"` quantizes the other linear projections after loading
    (those matching `quantization_exclude`, default: attention and lm_head, stay).
    A family's multipliers are folded into the weights they scale once the weights are read
    (`fold_multipliers=False` keeps them as separate multiplies: the unfolded reference).
    `tp`: the model comes back sharded for this rank (`distributed/sharding.py`)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
    if quantization not in (None, *ONLINE_QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; use one of "
                         f"{', '.join(ONLINE_QUANTIZATIONS)} (or none)")
    cfg = cfg or ModelConfig.from_hf(path)
    files = checkpoint_files(path) if load_format == "auto" else []
    device = torch.device(device)
    fp8_ckpt = None
    if load_format == "auto":
        raw = json.loads((path / "config.json").read_text())
        fp8_ckpt = read_checkpoint_quantization(path, raw)

    tp = tp or TPGroup.single()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy" and tp.tp_size > 1 and quantization is None:
        return _random_shard(model, cfg, device, seed, fold_multipliers, tp)
    if load_format == "dummy":
        model = _materialize(model, device)
        if cfg.tie_word_embeddings:
            model.tie_lm_head()
        init_random_(model, cfg.num_layers, seed)
        return shard_model(_after_load(model, fold_multipliers, quantization,
                                       quantization_exclude), tp)

    name_map = checkpoint_name_map(cfg)
    if tp.tp_size > 1 and fp8_ckpt is None and quantization is None:
        return _load_by_layer(model, cfg, path, files, name_map, device, fold_multipliers, tp)
    model = _materialize(model, device)
    if fp8_ckpt is not None:
        fp8_weight_modules(_fp8_weights(files, name_map), model)
        for name, p in model.named_parameters():
            if name.endswith("input_scale"):  # a per-half input scale loads as the maximum
                p.data.zero_()
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    expected = set(targets)
    state = _LoadState(name_map, fp8_ckpt is not None, files)
    with torch.no_grad(), contextlib.ExitStack() as files_open:
        for f in state.open_files(files_open):
            for key in f.keys():
                state.load_key(f, key, targets)
    state.tie_if_absent(model, cfg, expected)
    state.finish(cfg, path, expected, _rows(targets))
    return shard_model(_after_load(model, fold_multipliers, quantization, quantization_exclude),
                       tp)


class _LoadState:
    """One checkpoint read: the name map, which of our tensors are loaded (experts by index),
    the problems met, the progress bar."""

    def __init__(self, name_map, fp8: bool, files: list[Path]) -> None:
        self.name_map, self.fp8, self.files = name_map, fp8, files
        self.loaded: dict[str, set[int] | None] = {}
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []
        total = sum(f.stat().st_size for f in files)
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
                        disable=total < PROGRESS_BAR_MIN_BYTES)

    def open_files(self, stack: contextlib.ExitStack) -> list:
        """Every file opened (safetensors handles, closed with `stack`)."""
        handles = []
        for file in self.files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"cannot read checkpoint file {file}: {e}") from e
            handles.append(stack.enter_context(handle))
        return handles

    def load_key(self, f, key: str, targets: dict) -> None:
        """Checkpoint tensor `key` of the open file `f` into its place among `targets` (our
        names -> tensors), or a problem noted."""
        if key.startswith(_IGNORED_PREFIXES):
            return
        if self.fp8 and key.endswith(KV_SCALE_SUFFIXES):
            return  # FP8 KV-cache scales: the KV cache stays in the model dtype
        if self.fp8 and key.endswith(SCALE_SUFFIXES):
            problem = _load_scale(key, f.get_tensor(key), self.name_map, targets, self.loaded)
            if problem == "unexpected":
                self.unexpected.append(key)
            elif problem:
                self.misshaped.append(problem)
            return
        mapped = self.name_map(key)
        if mapped is None or mapped[0] not in targets:
            self.unexpected.append(key)
            return
        pname, expert = mapped
        tensor = f.get_tensor(key)
        dest = targets[pname] if expert is None else targets[pname][expert]
        if tensor.shape != dest.shape and tensor.numel() == dest.numel() and \
                pname.endswith(RESHAPEABLE):
            # HF conv1d weight is [D, 1, K]; fused gate|up [2I, H] into [2, I, H]
            tensor = tensor.reshape(dest.shape)
        if tensor.shape != dest.shape:
            self.misshaped.append(f"{key}: checkpoint {tuple(tensor.shape)} vs model "
                                  f"{tuple(dest.shape)}")
            return
        dest.copy_(tensor)
        self.bar.update(tensor.numel() * tensor.element_size())
        if expert is None:
            self.loaded[pname] = None
        else:
            seen = self.loaded.setdefault(pname, set())
            if seen is not None:
                seen.add(expert)

    def tie_if_absent(self, model: torch.nn.Module, cfg: ModelConfig, expected: set) -> None:
        if cfg.tie_word_embeddings and "lm_head.weight" not in self.loaded:
            # NOTE: transformers ties lm_head to the embeddings only when the checkpoint has no
            # lm_head.weight (NemotronH never ties: its tied-keys map is empty, and it saves it).
            model.tie_lm_head()
            expected.discard("lm_head.weight")

    def finish(self, cfg: ModelConfig, path: Path, expected: set, rows: dict[str, int]) -> None:
        """One ValueError naming every problem met (missing, unexpected, mis-shaped tensors);
        `rows`: our tensors' first dimension (the expert count of stacked experts)."""
        self.bar.close()
        missing = []
        for n in sorted(expected):
            if n not in self.loaded:
                missing.append(n)
            elif self.loaded[n] is not None and len(self.loaded[n]) != rows[n]:
                missing.append(f"{n} (experts {sorted(set(range(rows[n])) - self.loaded[n])})")
        problems = []
        if missing:
            problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if self.unexpected:
            problems.append(f"unexpected tensors: {self.unexpected[:8]}"
                            f"{' ...' if len(self.unexpected) > 8 else ''}")
        if self.misshaped:
            problems.append(f"mis-shaped tensors: {self.misshaped[:8]}")
        if problems:
            raise ValueError(f"checkpoint {path} does not match the {cfg.architecture} config: "
                             + "; ".join(problems))


_LAYER = re.compile(r"layers\.(\d+)\.")


def _load_by_layer(model: torch.nn.Module, cfg: ModelConfig, path: Path, files: list[Path],
                   name_map, device: torch.device, fold: bool, tp: TPGroup) -> torch.nn.Module:
    """A checkpoint for rank `tp`, one decoder layer at a time: the embedding / final norm /
    lm_head are loaded whole first (a few GB at most), then each layer is materialized, loaded
    whole, folded and sharded before the next, then the outer part is folded and vocab-sharded.
    The device never holds more than the rank's shard, the outer part and one whole layer. The
    same tensors, bit for bit, as loading the whole model and then `shard_model`."""
    expected = {n for n, _ in _tensors(model)}
    rows: dict[str, int] = {}
    state = _LoadState(name_map, False, files)
    with torch.no_grad(), contextlib.ExitStack() as files_open:
        handles = state.open_files(files_open)
        by_layer: dict[int | None, list[tuple[int, str]]] = {}
        for i, f in enumerate(handles):
            for key in f.keys():
                mapped = None if key.startswith(_IGNORED_PREFIXES) else name_map(key)
                m = _LAYER.match(mapped[0]) if mapped is not None else None
                by_layer.setdefault(int(m.group(1)) if m else None, []).append((i, key))
        for name, child in model.named_children():
            if name != "layers":
                _materialize(child, device)
        targets = {n: t for n, t in _tensors(model) if not n.startswith("layers.")}
        rows |= _rows(targets)
        for i, key in by_layer.pop(None, []):
            state.load_key(handles[i], key, targets)
        state.tie_if_absent(model, cfg, expected)
        for index, layer in enumerate(model.layers):
            _materialize(layer, device)
            targets = dict(_tensors(layer, f"layers.{index}"))
            rows |= _rows(targets)
            for i, key in by_layer.pop(index, []):
                state.load_key(handles[i], key, targets)
            targets = None  # the whole layer's tensors go once it is sharded
            if fold and hasattr(model, "fold_layer"):
                model.fold_layer(layer)
            shard_layer(layer, tp)
        for keys in by_layer.values():  # layers the model does not have
            state.unexpected += [key for _, key in keys]
    state.finish(cfg, path, expected, rows)
    if fold and hasattr(model, "fold_outer"):
        model.fold_outer()
    return shard_vocab(model, tp).eval()


def _rows(targets: dict) -> dict[str, int]:
    return {n: t.shape[0] for n, t in targets.items() if t.dim()}


def _tensors(module: torch.nn.Module, prefix: str = ""):
    """(name, tensor) of every parameter (shared ones under each name) and buffer."""
    yield from module.named_parameters(prefix=prefix, remove_duplicate=False)
    yield from module.named_buffers(prefix=prefix)


def _materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The meta model's storage on `device` (uninitialized; buffers zero), the router's
    parameters in float32; parameters shared between modules (tied embeddings) stay shared."""
    slots = [(mod, name, id(p)) for mod in model.modules()
             for name, p in mod.named_parameters(recurse=False)]
    model = model.to_empty(device=device)
    first: dict[int, torch.nn.Parameter] = {}
    for mod, name, key in slots:  # to_empty gives each occurrence its own tensor
        setattr(mod, name, first.setdefault(key, getattr(mod, name)))
    for name, p in model.named_parameters():
        if name.endswith(_FLOAT32_PARAMS):
            p.data = p.data.float()
    for name, b in model.named_buffers():
        # a checkpoint overwrites them; random weights keep zero (no bias)
        b.data = (b.data.float() if name.endswith(_FLOAT32_PARAMS) else b.data).zero_()
    return model


def _random_shard(model: torch.nn.Module, cfg: ModelConfig, device: torch.device, seed: int,
                  fold: bool, tp: TPGroup) -> torch.nn.Module:
    """Random weights for rank `tp` of a meta model: tie, fold the multipliers (shapes only: the
    random draw stands for the folded weights), shard, then materialize and draw the rank's
    shard (its own stream: `seed` + rank)."""
    if cfg.tie_word_embeddings:
        model.tie_lm_head()
    if fold and hasattr(model, "fold_multipliers"):
        model.fold_multipliers()
    model = _materialize(shard_model(model, tp), device)
    init_random_(model, cfg.num_layers, seed + tp.tp_rank)
    return model.eval()


def _after_load(model: torch.nn.Module, fold: bool, quantization: str | None,
                exclude: str | None) -> torch.nn.Module:
    """Fold the multipliers (families that have them), then quantize on the fly (the folded
    weights); sharding comes after, in the caller."""
    if fold and hasattr(model, "fold_multipliers"):
        model.fold_multipliers()
    if quantization == "fp8":
        quantize_model_fp8(model, exclude_patterns(exclude))
    return model.eval()


def _fp8_weights(files: list[Path], name_map) -> dict[str, bool]:
    """Our weight parameter names whose checkpoint tensor is float8_e4m3fn -> whether the
    checkpoint gives that module a static input_scale (read from the file headers only)."""
    keys, fp8 = set(), []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                keys.add(key)
                if f.get_slice(key).get_dtype() == "F8_E4M3" and not \
                        key.startswith(_IGNORED_PREFIXES):
                    fp8.append(key)
    out = {}
    for key in fp8:
        mapped = name_map(key)
        if mapped is None:
            continue
        base = key.rsplit(".", 1)[0] if key.endswith(".weight") else key
        out[mapped[0]] = out.get(mapped[0], False) or f"{base}.input_scale" in keys
    return out


def _load_scale(key: str, tensor: torch.Tensor, name_map, targets: dict,
                loaded: dict) -> str | None:
    """Copy an FP8 checkpoint's `<module>.weight_scale` / `.input_scale` into the FP8 module
    its weight went to; returns "unexpected" or a mis-shape line on a problem, else None."""
    base, _, kind = key.rpartition(".")
    mapped = name_map(f"{base}.weight")
    if mapped is None:
        return "unexpected"
    wname, index = mapped
    sname = wname + "_scale" if kind == "weight_scale" else \
        wname[: -len("weight")] + "input_scale"
    if sname not in targets:  # a scale of no FP8 weight
        return "unexpected"
    dest = targets[sname]
    t = tensor.float()
    if kind == "input_scale":
        if t.numel() != 1:
            return f"{key}: checkpoint {tuple(t.shape)} vs a per-tensor input scale"
        dest.copy_(torch.maximum(dest, t.reshape(()).to(dest.device)))
        loaded[sname] = None
        return None
    part = dest if index is None else dest[index]
    if t.numel() == 1:
        part.copy_(t.reshape(()).expand(part.shape))
    elif t.numel() == part.numel():
        part.copy_(t.reshape(part.shape))
    else:
        return f"{key}: checkpoint {tuple(t.shape)} vs model {tuple(part.shape)}"
    if index is None:
        loaded[sname] = None
    else:
        seen = loaded.setdefault(sname, set())
        if seen is not None:
            seen.add(index)
    return None


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all the model's weights, bytes of its routed experts' weights); tied weights
    counted once."""
    total = experts = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        total += n
        experts += n if name.rsplit(".", 1)[-1].startswith("experts_") else 0
    return total, experts
