"""One rank's model and memory: load the checkpoint, shard it for tensor parallelism, size and
build the state and KV pools at the rank's local layer sizes, the runner and its decode CUDA
graphs. The engine builds its own (rank 0, or the only rank) with `build_rank`; the worker
processes of tensor parallelism (distributed/worker.py) build theirs with the same function,
so every rank holds the same number of state slots and KV pages and captures the same graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.config import (
    DEFAULT_PREFILL_GRAPH_TOKENS,
    DEFAULT_SOLO_GRAPH_TOKENS,
    EngineConfig,
    ModelConfig,
    resolve_dtype,
)
from mambaserve.distributed.group import TPGroup
from mambaserve.engine.runner import ModelRunner
from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.models.loader import load_model, weight_bytes

logger = logging.getLogger("mambaserve")
DEFAULT_CPU_BUDGET = 1 << 30

# (state slots, KV pages) this rank can hold -> the numbers every rank uses (their minimum)
Agree = Callable[[int, int], tuple[int, int]]


@dataclass
class RankModel:
    """What one rank holds: its (sharded) model, pools and runner, and their sizes."""

    model: torch.nn.Module
    local_config: ModelConfig  # the model's config at this rank's layer sizes
    state_pool: StatePool
    kv_pool: KVPool
    runner: ModelRunner
    dtype: torch.dtype
    ssm_dtype: torch.dtype
    weight_bytes: int
    expert_weight_bytes: int

    def memory_report(self) -> dict:
        return {"device": str(self.runner.device), "tp_rank": self.runner.tp.tp_rank,
                "weight_bytes": self.weight_bytes,
                "expert_weight_bytes": self.expert_weight_bytes,
                "state_slots": self.state_pool.num_slots,
                "state_bytes": self.state_pool.nbytes,
                "state_bytes_per_slot": StatePool.bytes_per_slot(
                    self.local_config, self.dtype, self.ssm_dtype),
                "kv_pages": self.kv_pool.num_pages, "kv_page_size": self.kv_pool.page_size,
                "kv_bytes": self.kv_pool.nbytes}


def local_config(cfg: ModelConfig, model: torch.nn.Module) -> ModelConfig:
    """`cfg` with the head and group counts of this rank's shard (read from the sharded
    layers): the sizes its state and KV pools are built at. `cfg` itself at one rank."""
    mixer = next((m for m in model.modules() if isinstance(m, Mamba2Mixer)), None)
    attn = next((m for m in model.modules() if isinstance(m, Attention)), None)
    changes = {}
    if mixer is not None:
        changes.update(mamba_num_heads=mixer.num_heads, n_groups=mixer.n_groups)
    if attn is not None:
        changes.update(num_attention_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)
    local = dataclasses.replace(cfg, **changes)
    if mixer is not None and local.conv_dim != mixer.conv_dim:
        raise RuntimeError(f"the sharded mixer's conv_dim {mixer.conv_dim} is not its heads' "
                           f"and groups' ({local.conv_dim})")
    return local


def pool_sizes(cfg: ModelConfig, c: EngineConfig, dtype: torch.dtype, ssm_dtype: torch.dtype,
               device: torch.device, max_model_len: int) -> tuple[int, int]:
    """(state slots, KV pages) that fit the memory budget, at `cfg`'s (local) layer sizes."""
    slot_bytes = StatePool.bytes_per_slot(cfg, dtype, ssm_dtype)
    page_bytes = KVPool.bytes_per_page(cfg, c.page_size, dtype)
    budget = c.memory_budget_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * c.gpu_memory_utilization) - (2 << 30)  # activations
        else:
            budget = DEFAULT_CPU_BUDGET
    pages_per_seq = -(-max_model_len // c.page_size)
    # with prefix caching a request may hold a private snapshot slot besides its live one,
    # and cached snapshots need slots of their own
    want_slots = c.max_num_seqs * 3 + 8 if c.enable_prefix_caching else c.max_num_seqs
    if page_bytes == 0:  # no attention layers: pages are free bookkeeping
        num_slots = min(want_slots, budget // max(slot_bytes, 1))
        num_pages = max(1, num_slots) * pages_per_seq
    else:
        # never more pages than every sequence at full length (twice that for cached
        # prefixes); when slots and pages both fit, take exactly that, else split the budget
        full = c.max_num_seqs * pages_per_seq * (2 if c.enable_prefix_caching else 1)
        if want_slots * slot_bytes + full * page_bytes <= budget:
            num_slots, num_pages = want_slots, full
        else:
            num_slots = min(want_slots, (budget // 2) // max(slot_bytes, 1))
            num_pages = min((budget - num_slots * slot_bytes) // page_bytes, full)
    if num_slots < 1 or num_pages < 1:
        raise ValueError(
            f"memory budget of {budget / 2**20:.1f} MiB is too small: one state slot needs "
            f"{slot_bytes / 2**20:.2f} MiB and one KV page {page_bytes / 2**20:.3f} MiB")
    return int(num_slots), int(num_pages)


# A prefill-only step (a lone prompt: nothing decoding beside it) replays a graph up to at least
# this many times cuda_graph_max_prefill_tokens (DEFAULT_SOLO_GRAPH_TOKENS by default): eagerly,
# a 512-token prompt of the 9B is bound by the host's ~1,000 launches (22-44 ms against 15.8 ms
# replayed, docs/benchmarks.md), while the steps with decode rows keep the bound, which is also
# the serving slice (`_steady_prefill_cap`)
SOLO_PREFILL_GRAPH_FACTOR = 2


def solo_graph_tokens(config: EngineConfig, bound: int, max_model_len: int) -> int:
    """The largest prefill-only graph: cuda_graph_max_solo_tokens as set, else the larger of
    DEFAULT_SOLO_GRAPH_TOKENS and SOLO_PREFILL_GRAPH_FACTOR x bound, the default kept within
    max_model_len (a lone prompt is no longer); never below `bound` nor above
    chunked_prefill_size."""
    solo = config.cuda_graph_max_solo_tokens
    if solo is None:
        solo = min(max(DEFAULT_SOLO_GRAPH_TOKENS, SOLO_PREFILL_GRAPH_FACTOR * bound),
                   max_model_len)
    return min(max(solo, bound), config.chunked_prefill_size)


def prefill_graph_tokens(config: EngineConfig, device: torch.device) -> int:
    """cuda_graph_max_prefill_tokens as set, else DEFAULT_PREFILL_GRAPH_TOKENS on CUDA, 0 (no
    prefill graphs) elsewhere."""
    if config.cuda_graph_max_prefill_tokens is not None:
        return config.cuda_graph_max_prefill_tokens
    return DEFAULT_PREFILL_GRAPH_TOKENS if device.type == "cuda" else 0


def prefill_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int):
    """Prefill / mixed-step graphs (engine/prefill_graph.py), captured into the decode graphs'
    memory pool: prefill parts up to cuda_graph_max_prefill_tokens (no more than a step's token
    budget), prefill-only steps up to `solo_graph_tokens`, decode rows up to
    the decode graphs' largest bucket (at most MAX_MIXED_DECODES)."""
    from mambaserve.engine.prefill_graph import MAX_MIXED_DECODES, PrefillGraphRunner

    bound = prefill_graph_tokens(config, runner.device)
    graphs = PrefillGraphRunner(
        runner.model, runner.state_pool, runner.kv_pool,
        max_tokens=min(bound, config.chunked_prefill_size),
        max_solo_tokens=solo_graph_tokens(config, bound, max_model_len),
        max_decodes=min(runner.graph_runner.max_bs, MAX_MIXED_DECODES),
        max_model_len=max_model_len, snapshots=config.enable_prefix_caching,
        device=runner.device, head_start=runner.tp.tp_size == 1)
    graphs.capture(runner.graph_runner.pool)
    return graphs


def build_rank(path: str | Path, config: EngineConfig, model_config: ModelConfig,
               device: torch.device, max_model_len: int, tp: TPGroup | None = None,
               agree: Agree | None = None) -> RankModel:
    """Load, shard (`tp`: this rank's group; one rank when None), size the pools (`agree`
    makes every rank take the same numbers), build the runner and capture the CUDA graphs."""
    tp = tp or TPGroup.single()
    dtype = resolve_dtype(config.dtype, model_config, device.type)
    ssm_dtype = resolve_dtype(config.mamba_ssm_dtype)
    model = load_model(Path(path), dtype, device, model_config, config.load_format, config.seed,
                       config.quantization, config.quantization_exclude, tp=tp)
    for m in model.modules():  # q, k, v as one GEMM per attention layer (after sharding)
        if isinstance(m, Attention):
            m.pack_qkv()
    if hasattr(model, "pack_mixer_projections"):  # with Mamba's where a layer has both mixers
        model.pack_mixer_projections()
    model.route_fp8_inputs()  # norms writing FP8 rows for FP8 projections of dynamic scales
    local = local_config(model_config, model)
    wb, eb = weight_bytes(model)
    logger.info("weights%s: %.2f GiB (%s)", f" of rank {tp.tp_rank}" if tp.tp_size > 1 else "",
                wb / 2**30, f"routed experts {eb / 2**30:.2f} GiB" if eb else "no routed experts")
    slots, pages = pool_sizes(local, config, dtype, ssm_dtype, device, max_model_len)
    if agree is not None:
        slots, pages = agree(slots, pages)
    sp = StatePool(local, slots, dtype, ssm_dtype, device)
    kv = KVPool(local, pages, config.page_size, dtype, device)
    logger.info("state pool: %d slots x %.2f MiB = %.1f MiB (ssm state %s); KV pool: %d pages "
                "x %d tokens = %.1f MiB", sp.num_slots,
                StatePool.bytes_per_slot(local, dtype, ssm_dtype) / 2**20, sp.nbytes / 2**20,
                ssm_dtype, kv.num_pages, config.page_size, kv.nbytes / 2**20)
    runner = ModelRunner(model, sp, kv, device)
    runner.tp = tp
    eager = config.enforce_eager if config.enforce_eager is not None else device.type != "cuda"
    if not eager:
        from mambaserve.engine.cuda_graph import CudaGraphRunner

        runner.graph_runner = CudaGraphRunner(
            model, sp, kv, max_bs=min(config.cuda_graph_max_bs, config.max_num_seqs),
            max_model_len=max_model_len, snapshots=config.enable_prefix_caching, device=device)
        runner.graph_runner.capture()  # under tensor parallelism every rank captures in step
        if prefill_graph_tokens(config, device):
            runner.prefill_graph_runner = prefill_graphs(runner, config, max_model_len)
    return RankModel(model, local, sp, kv, runner, dtype, ssm_dtype, wb, eb)
