"""`dsjax bench`: prefill and decode throughput of the engine on random weights, against the roofline.

The engine runs as `generate` runs it (the scheduler's prefill, then one decode step per token with
the sampled tokens read back each step). The roofline of a configuration is the time the device
needs at its measured copy bandwidth and matmul rate for the bytes each step must move and the FLOPs
it must do (`roofline`); the per-part split of a decode step comes from a profiler trace whose kernels
are attributed to the model's named scopes (`attention`, `indexer`, `moe`; everything else is
`rest`), where the backend's trace has kernel events (GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import re
import tempfile
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.cache import layer_cache
from dsjax.config import CSA, HCA, ModelConfig
from dsjax.config_v41 import V41Config, is_v41
from dsjax.engine import scheduler
from dsjax.engine.aot import stored_config
from dsjax.engine.acceptance import Acceptance
from dsjax.engine.engine import Engine
from dsjax.engine.programs import program_store
from dsjax.engine.sampling import SamplingArrays, SamplingModes, SamplingParams
from dsjax.engine.slots import prefill_rows
from dsjax.info import component
from dsjax.model import DeepseekV4
from dsjax.model_v41 import DeepseekV41
from dsjax.parallel.shard import abstract_on_mesh
from dsjax.presets import PRESETS
from dsjax.run_config import RunConfig

PARTS = ("attention", "indexer", "topk", "moe", "collectives", "rest")
# Collectives by HLO instruction (all-to-all.3, all-gather-start.1, ...); NCCL's kernels by name.
_COLLECTIVE = re.compile(r"(?:ragged[-_])?(?:all[-_]to[-_]all|all[-_]gather|all[-_]reduce|reduce[-_]scatter|"
                         r"collective[-_]permute)")


def bench_config(preset: str, layers: int | Sequence[int] | None = None, weights: str = "bf16",
                 engram_rows: int | None = None) -> ModelConfig | V41Config:
    """The preset's config, cut to its first `layers` decoder layers (for V4.1 also a list of the release's
    layers, `v41_slice`); `weights` (`run_config.WEIGHTS`) "keep" stores it as DeepSeek releases it (FP8
    blocks, FP4 routed experts), "bf16" as float weights."""
    weights = RunConfig(weights=weights).weights  # checked, and "fp8" read as "keep" with a warning
    if is_v41(PRESETS.get(preset, {})):
        cfg = V41Config.preset(preset)
        if layers is not None:
            cfg = v41_slice(cfg, range(layers) if isinstance(layers, int) else layers, engram_rows)
        return stored_config(cfg, weights)
    if layers is not None and not isinstance(layers, int):
        raise ValueError(f"--layers takes a count for a V4 preset (its first N layers), got {list(layers)}")
    cfg = ModelConfig.preset(preset)
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"--layers must be between 1 and the preset's {cfg.num_hidden_layers}, got {layers}")
        cfg = cfg.replace(num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                          mlp_layer_types=cfg.mlp_layer_types[:layers])
    return stored_config(cfg, weights)


def v41_slice(cfg: V41Config, layers: Sequence[int], engram_rows: int | None = None) -> V41Config:
    """The release's layers `layers` (increasing) as a model of their own, each in the same role: the source
    lists, the candidate source and Engram renumbered. `engram_rows` shrinks each Engram table to about that
    many rows (bucket primes from a smaller start): a lookup reads its 2·24 rows whatever the table's size,
    so only the table's memory changes. A layer whose KV source is not in the slice is refused."""
    layers = list(layers)
    if layers != sorted(set(layers)) or not layers or layers[0] < 0 or layers[-1] >= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be increasing layer indices below {cfg.num_hidden_layers}, got {layers}")
    new = {old: i for i, old in enumerate(layers)}
    keep = lambda ids: tuple(new[i] for i in ids if i in new)  # noqa: E731
    engram = [(new[i], rows) for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if i in new]
    out = cfg.replace(
        num_hidden_layers=len(layers),
        compress_ratios=tuple(cfg.compress_ratios[i] for i in layers),
        kv_source_layer_ids=keep(cfg.kv_source_layer_ids), index_source_layer_ids=keep(cfg.index_source_layer_ids),
        candidate_source_layer_id=new.get(cfg.candidate_source_layer_id, -1),
        engram_layer_ids=tuple(i for i, _ in engram), engram_num_embeddings=tuple(r for _, r in engram),
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), vision=None)
    if engram_rows is not None and out.engram_layer_ids:
        from dsjax.engram_hash import bucket_primes

        start = max(2, engram_rows // out.engram_hash_heads)
        primes = bucket_primes(len(out.engram_layer_ids), out.engram_max_ngram_size, out.engram_n_heads, start)
        out = out.replace(engram_vocab_size=start, engram_num_embeddings=tuple(int(p.sum()) for p in primes))
    old_roles = cfg.layer_roles()
    for role in out.layer_roles():
        was = old_roles[layers[role.index]]
        kept = ((role.ratio, role.mode, role.uses_candidates, role.candidate_source, role.engram is None)
                == (was.ratio, was.mode, was.uses_candidates, was.candidate_source, was.engram is None)
                and (None if role.kv_source is None else layers[role.kv_source]) == was.kv_source)
        if not kept:
            raise ValueError(f"layer {was.index} ({was.mode}) does not keep its role in the slice {layers}: its KV "
                             "source, index source or candidate source is missing")
    return out


def random_model(cfg: ModelConfig | V41Config, seed: int = 0, dtype=jnp.bfloat16,
                 mesh: jax.sharding.Mesh | None = None) -> DeepseekV4 | DeepseekV41:
    """A model with the initializer's random weights, built in one compiled program on the default
    device (no float32 copy of the experts is ever whole in memory), or with `mesh` straight onto it, each
    device computing only its share as the rules table places it (a model larger than one device: the same
    weights as built on one device and then placed). Hash-routed layers get a random `tid2eid` (k distinct
    experts per token, as a checkpoint has): the initializer's zeros would send every token to expert 0
    and make the MoE look cheaper than it is."""
    build = functools.partial(_random_v41 if cfg.family == "v4.1" else _random_v4, cfg, seed, dtype)
    if mesh is None:
        return nnx.jit(build)()
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = jax.tree.map(lambda x: x.sharding, abstract_on_mesh(abstract, mesh))
    state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def _random_v41(cfg: V41Config, seed: int, dtype) -> DeepseekV41:
    return DeepseekV41(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


def _random_v4(cfg: ModelConfig, seed: int, dtype) -> DeepseekV4:
    model = DeepseekV4(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    key = jax.random.key(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] == "tid2eid":
            key, sub = jax.random.split(key)
            shape = var.get_value().shape  # [repeats, vocab, k]
            noise = jax.random.uniform(sub, (*shape[:-1], cfg.n_routed_experts))
            var.set_value(jax.lax.top_k(noise, shape[-1])[1].astype(var.get_value().dtype))
    return model


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    copy_bytes_per_s: float  # bytes read plus bytes written, per second, of a device-to-device copy
    matmul_flops_per_s: float  # bf16 matmul rate (an 8192² × 8192 product)

    def time(self, n_bytes: float, flops: float) -> float:
        """Seconds the device needs at least for these bytes and FLOPs (whichever bounds)."""
        return max(n_bytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s)


def _best_seconds(fn, arg, runs: int = 5) -> float:
    jax.block_until_ready(fn(arg))
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(n_bytes: int = 2 << 30) -> float:
    """Bytes per second (read plus written) of a device-to-device copy on the default device: PyTorch's
    copy (a DMA-engine memcpy, the fastest copy measured on the H200: 4.28 TB/s) where PyTorch has CUDA,
    else an XLA elementwise pass over `n_bytes`, which reaches less; the best of a few runs."""
    try:
        import torch

        if torch.cuda.is_available():
            a, b = (torch.empty(n_bytes, dtype=torch.uint8, device="cuda") for _ in range(2))
            for _ in range(3):
                b.copy_(a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                b.copy_(a)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / 10
            del a, b
            torch.cuda.empty_cache()
            return 2 * n_bytes / seconds
    except ImportError:
        pass
    x = jnp.zeros((n_bytes // 2,), jnp.bfloat16)
    return 2 * n_bytes / _best_seconds(jax.jit(lambda x: x + 1), x)  # reads and writes every byte once


def measure_rates(copy_bytes: int = 2 << 30, n: int = 8192) -> DeviceRates:
    """The default device's copy bandwidth (`copy_bandwidth`) and bf16 matmul rate (best of a few runs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    return DeviceRates(copy_bandwidth(copy_bytes), 2 * n ** 3 / _best_seconds(jax.jit(lambda a: a @ a), a))


def _leaves(model: DeepseekV4):
    """(component, path, bytes, elements) of every variable, layers stacked as stored."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = [str(p) for p in path]
        if names[0] == "groups":  # ("groups", g, "layers", i, ...) → the layer's own path
            names = names[4:]
        value = var.get_value()
        name = ".".join(names)
        comp = "scale" if name.endswith("_scale_inv") else component(name)
        yield comp, name, value.size * value.dtype.itemsize, value.size


def touched_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected fraction of a layer's routed experts that `tokens` tokens select, with each token's k
    experts spread uniformly (random weights route nearly so)."""
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    return 1.0 - (1.0 - k / e) ** tokens


def _attended_rows(cfg: ModelConfig, attention_type: str, context: int) -> tuple[int, int]:
    """(K=V rows one query attends, index keys its indexer scores) at `context` tokens."""
    rows = min(cfg.sliding_window, context)
    if attention_type == HCA:
        return rows + context // cfg.compress_rate_hca, 0
    if attention_type == CSA:
        entries = context // cfg.compress_rate_csa
        return rows + min(cfg.index_topk, entries), entries
    return rows, 0


def _cache_read_bytes(cfg: ModelConfig, attention_type: str, context: int, dtype, kv_dtype) -> float:
    """Cache bytes one slot's decode step reads in one layer at `context` tokens: the window ring, the
    compressor's buffers, every HCA entry, every CSA index key and the CSA entries the indexer picks."""
    one = jax.eval_shape(lambda: layer_cache(cfg, attention_type, 1, max(context, 1), dtype, kv_dtype))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))
    if attention_type == CSA and one.compressor is not None:
        entries = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one.compressor.entries))
        n = max(context // cfg.compress_rate_csa, 1)
        total -= entries * (1 - min(cfg.index_topk, n) / n)
    return total


def _layer_flops_per_token(cfg: ModelConfig, attention_type: str, context: int) -> int:
    """Attention and indexer FLOPs of one query at `context` tokens (products of the shared K=V head
    with every query head: scores and values)."""
    rows, keys = _attended_rows(cfg, attention_type, context)
    return 4 * cfg.num_attention_heads * cfg.head_dim * rows + 2 * cfg.index_n_heads * cfg.index_head_dim * keys


def _prompt_flops(cfg: ModelConfig, attention_type: str, prompt_len: int) -> float:
    """`_layer_flops_per_token` summed over a prompt's queries at contexts 1 … prompt_len (vectorised: a
    1M-token prompt has a million of them)."""
    ctx = np.arange(1, prompt_len + 1, dtype=np.int64)
    rows, keys = np.minimum(cfg.sliding_window, ctx), np.zeros_like(ctx)
    if attention_type == HCA:
        rows = rows + ctx // cfg.compress_rate_hca
    elif attention_type == CSA:
        keys = ctx // cfg.compress_rate_csa
        rows = rows + np.minimum(cfg.index_topk, keys)
    return float(4 * cfg.num_attention_heads * cfg.head_dim * rows.sum()
                 + 2 * cfg.index_n_heads * cfg.index_head_dim * keys.sum())


def roofline(model: DeepseekV4, batch: int, prompt_len: int, gen_len: int, rates: DeviceRates,
             kv_dtype: str | None = None) -> dict:
    """The least time the device needs for the prefill of `batch` prompts of `prompt_len` tokens and
    for one decode step of `batch` slots at the mean context of the generation, from bytes and FLOPs:

    - decode bytes: every weight except the embedding table (one row per token) and the routed
      experts, of which the expected touched fraction (`touched_experts`); the cache rows each slot's
      attention and indexer read; decode FLOPs: 2 per active weight per token plus attention;
    - prefill: the weights once, the cache written once; 2 FLOPs per active weight per token plus
      causal attention over the prompt.
    """
    cfg = model.cfg
    context = prompt_len + gen_len // 2
    by_comp: dict[str, float] = {}
    expert_elems = active_elems = 0
    for comp, _name, n_bytes, n in _leaves(model):
        by_comp[comp] = by_comp.get(comp, 0) + n_bytes
        if comp == "routed_experts":
            expert_elems += n
        elif comp not in ("embedding", "scale"):
            active_elems += n
    active_elems += expert_elems * cfg.num_experts_per_tok / cfg.n_routed_experts
    emb_row = by_comp.get("embedding", 0) / cfg.vocab_size
    dense = sum(v for c, v in by_comp.items() if c not in ("embedding", "routed_experts"))
    experts = by_comp.get("routed_experts", 0)
    dtype = jnp.dtype(model.dtype)
    cache_read = sum(_cache_read_bytes(cfg, t, context, dtype, kv_dtype) for t in cfg.layer_types)
    attn_flops = sum(_layer_flops_per_token(cfg, t, context) for t in cfg.layer_types)
    decode_weight_bytes = dense + experts * touched_experts(cfg, batch) + emb_row * batch
    decode_bytes = decode_weight_bytes + batch * cache_read
    decode_flops = batch * (2 * active_elems + attn_flops)
    prompt_attn = sum(_prompt_flops(cfg, t, prompt_len) for t in cfg.layer_types)
    prefill_flops = batch * (2 * active_elems * prompt_len + prompt_attn)
    cache_written = batch * sum(_cache_read_bytes(cfg, t, prompt_len, dtype, kv_dtype) for t in cfg.layer_types)
    prefill_bytes = dense + experts * touched_experts(cfg, batch * prompt_len) + cache_written
    decode_s = rates.time(decode_bytes, decode_flops)
    prefill_s = rates.time(prefill_bytes, prefill_flops)
    return {"context": context, "decode_step_bytes": decode_bytes, "decode_weight_bytes": decode_weight_bytes,
            "decode_cache_bytes": batch * cache_read, "decode_step_flops": decode_flops,
            "decode_step_s": decode_s, "decode_tokens_per_s": batch / decode_s,
            "decode_bound": "memory" if decode_bytes / rates.copy_bytes_per_s >= decode_flops / rates.matmul_flops_per_s
            else "compute",
            "prefill_bytes": prefill_bytes, "prefill_flops": prefill_flops, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt_len / prefill_s, "weight_bytes": sum(by_comp.values())}


def roofline_v41(model, batch: int, prompt_len: int, gen_len: int, rates: DeviceRates,
                 decoder_prefill: str = "exact", kv_dtype: str | None = None) -> dict:
    """`roofline` for a DeepSeek-V4.1 model: decode reads every weight but the embedding, the touched routed
    experts and the 2·24 Engram rows a token looks up, and per slot each layer's window, the index keys its
    indexer scores (Full and Reindex layers) and the entries it picks, in the cache's storage (`kv_dtype`);
    prefill runs the decoder layers on `decoder_keep` positions with exact truncation (all of them with
    "full")."""
    from dsjax.cache_formats import V41_STORAGE, v41_row_bytes
    from dsjax.model_v41 import decoder_keep

    cfg = model.cfg
    roles = cfg.layer_roles()
    context = prompt_len + gen_len // 2
    dense = experts = emb = table_row = 0.0
    layer_active = [0.0] * len(roles)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        name = ".".join(str(x) for x in path)
        if name.startswith("ngram_hash."):
            continue
        value = var.get_value()
        n_bytes = value.size * value.dtype.itemsize
        if name.startswith("embed_tokens"):
            emb += n_bytes
            continue
        if ".engram.table" in name:
            table_row += n_bytes / value.shape[0]
            continue
        layer = int(path[1]) if name.startswith("layers.") else None
        if ".ffn.experts." in name:
            experts += n_bytes
            share = cfg.num_experts_per_tok / cfg.n_routed_experts
        else:
            dense += n_bytes
            share = 1.0
        if layer is not None and not name.endswith(("_scale_inv", "_scale")):
            layer_active[layer] += value.size * share
    head_active = cfg.vocab_size * cfg.hidden_size
    if kv_dtype in V41_STORAGE:
        window_row, entry_row, key_row = v41_row_bytes(kv_dtype, cfg.head_dim, cfg.index_head_dim)
    else:
        size = jnp.dtype(jnp.bfloat16 if kv_dtype else model.dtype).itemsize
        window_row, entry_row, key_row = size * cfg.head_dim, size * cfg.head_dim, size * cfg.index_head_dim

    def per_token_attention(ctx: int) -> tuple[float, float]:
        """(cache bytes one query reads, attention and indexer FLOPs) over all layers at `ctx` tokens."""
        read = flops = 0.0
        for r in roles:
            rows = min(cfg.sliding_window, ctx)
            read += rows * window_row
            if r.ratio:
                entries = ctx // r.ratio
                picks = min(cfg.index_topk, entries)
                rows += picks
                read += picks * entry_row
                if r.mode in ("full", "reindex"):
                    read += entries * key_row
                    flops += 2 * cfg.index_n_heads * cfg.index_head_dim * entries
            flops += 4 * cfg.num_attention_heads * cfg.head_dim * rows
        return read, flops

    engram_layers = len(cfg.engram_layer_ids)
    cache_read, attn_flops = per_token_attention(context)
    decode_weight = dense + experts * touched_experts(cfg, batch) + batch * (
        emb / cfg.vocab_size + engram_layers * cfg.engram_hash_heads * table_row)
    decode_bytes = decode_weight + batch * cache_read
    decode_flops = batch * (2 * (sum(layer_active) + head_active) + attn_flops)
    keep = prompt_len if decoder_prefill == "full" else min(prompt_len, decoder_keep(cfg))
    first_dec = cfg.first_decoder_layer
    tokens = [prompt_len if i < first_dec else keep for i in range(len(roles))]
    _, attn_mean = per_token_attention(prompt_len // 2)
    prefill_flops = batch * (sum(2 * t * a for t, a in zip(tokens, layer_active)) + 2 * head_active
                             + attn_mean * (first_dec * prompt_len + (len(roles) - first_dec) * keep) / len(roles))
    cache_written, _ = per_token_attention(prompt_len)
    prefill_bytes = dense + experts * touched_experts(cfg, batch * prompt_len) + batch * cache_written
    decode_s, prefill_s = rates.time(decode_bytes, decode_flops), rates.time(prefill_bytes, prefill_flops)
    return {"context": context, "decode_step_bytes": decode_bytes, "decode_weight_bytes": decode_weight,
            "decode_cache_bytes": batch * cache_read, "decode_step_flops": decode_flops, "decode_step_s": decode_s,
            "decode_tokens_per_s": batch / decode_s,
            "decode_bound": "memory" if decode_bytes / rates.copy_bytes_per_s >= decode_flops / rates.matmul_flops_per_s
            else "compute",
            "prefill_bytes": prefill_bytes, "prefill_flops": prefill_flops, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt_len / prefill_s, "weight_bytes": dense + experts + emb}


def _hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name → the part its op_name metadata names, for every instruction of a compiled
    module's text; names are also keyed with '.' and '-' as '_' (kernel names spell them so)."""
    parts = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"", hlo_text, re.M):
        parts[m.group(1)] = parts[_kernel_name(m.group(1))] = _part_of(m.group(2))
    return parts


def _kernel_name(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def _part_of(op_name: str) -> str:
    scopes = op_name.split("/")
    # Innermost first: the indexer's top-k pick runs inside the indexer, the indexer inside attention.
    for part in ("topk", "indexer", "attention", "moe"):
        if part in scopes:
            return part
    return "rest"


def attribute_trace(trace_dir: str, hlo_text: str, steps: int) -> dict:
    """Seconds per step and device of each part, from the device kernels of a profiler trace (`trace_dir`,
    written by `jax.profiler.trace`) of `steps` runs of the compiled module `hlo_text`. Kernels are
    matched to the module's instructions by the `hlo_op` the GPU runtime records with each launch (else
    by their name); those that match none are counted as `unattributed`. Collectives (and NCCL's
    kernels) are their own part, wherever they run. With several devices in the trace (a mesh), the
    times are their mean (`devices` says how many). Returns {} where the trace has no device kernels
    (CPU)."""
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        return {}
    trace = json.load(gzip.open(max(files, key=os.path.getmtime)))
    pids = {p["pid"]: p.get("args", {}).get("name", "") for p in trace["traceEvents"]
            if p.get("ph") == "M" and p.get("name") == "process_name"}
    device_pids = {pid for pid, name in pids.items() if "/device:GPU" in name or "/device:TPU" in name}
    scopes = _hlo_scopes(hlo_text)
    seconds = dict.fromkeys((*PARTS, "unattributed"), 0.0)
    n_kernels = 0
    names: dict[str, float] = {}
    busy_pids = set()
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("pid") not in device_pids:
            continue
        busy_pids.add(ev["pid"])
        args = ev.get("args", {})
        op = args.get("hlo_op") or ev.get("name", "")
        collective = _COLLECTIVE.match(op) or ev.get("name", "").lower().startswith("nccl")
        if collective:
            part = "collectives"
        elif "/" in args.get("name", ""):  # the op's scope path itself
            part = _part_of(args["name"])
        else:
            part = scopes.get(op) or scopes.get(_kernel_name(op)) or scopes.get(_kernel_name(ev.get("name", "")))
        dur = float(ev.get("dur", 0)) * 1e-6
        seconds[part or "unattributed"] += dur
        n_kernels += 1
        key = f"{part or 'unattributed'}: {ev.get('name', '')[:60]}"
        names[key] = names.get(key, 0.0) + dur
    if not n_kernels:
        return {}
    per = steps * len(busy_pids)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return ({k: v / per for k, v in seconds.items()} | {"kernels_per_step": n_kernels / per}
            | {"top_kernels": {k: v / per for k, v in top}, "devices": len(busy_pids)})


def _requests(cfg: ModelConfig, batch: int, prompt_len: int, gen_len: int, seed: int) -> list[scheduler.Request]:
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len)
    return [scheduler.Request(i, tuple(int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len)), sp, i,
                              frozenset()) for i in range(batch)]


def _timed_run(engine: Engine, requests: list[scheduler.Request],
               acceptance: Acceptance | None = None) -> tuple[float, float, int]:
    """(seconds to the first token of every request, seconds of the decode steps after it, decode
    steps) of one scheduler run: all requests share one prefill (the engine has a slot each). With
    speculative decoding the "steps" are tokens per request (a verification step emits several), and
    `acceptance` counts what the verification kept."""
    n = len(requests)
    t0 = time.perf_counter()
    t_first = None
    seen = 0
    steps = 0
    for ev in scheduler.run(engine, requests, acceptance=acceptance):
        seen += 1
        if seen == n:
            t_first = time.perf_counter()
        elif seen > n and (seen - n) % n == 0:
            steps += 1
    t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, steps


def peak_memory(devices: Sequence[jax.Device] | None = None) -> list[int | None]:
    """Peak bytes in use on each of `devices` (default: the default device) since the process started,
    where the backend says (None where it does not)."""
    return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in (devices or jax.devices()[:1])]


def run_bench(model: DeepseekV4, batch: int, prompt_len: int, gen_len: int, *, run: RunConfig,
              rates: DeviceRates | None = None, breakdown: bool = True, seed: int = 0, trace_dir: str | None = None,
              mesh: jax.sharding.Mesh | None = None) -> dict:
    """Prefill `batch` random prompts of `prompt_len` tokens and generate `gen_len` tokens each, greedily
    and without stop tokens, through the scheduler; the same once before to compile. The engine runs as
    `run` says, with `batch` slots of exactly `prompt_len + gen_len` tokens (`run.slots` and `run.max_len`
    are replaced). Raises RuntimeError if the measured run compiled anything. With `mesh` (the model's
    variables placed on it, `parallel.shard_model` or `load_model(..., mesh=)`), the engine runs under it:
    `batch` sequences over the whole mesh, peak memory per device, the per-part split per device; no
    roofline past one device (it counts the whole model's bytes)."""
    if batch < 1 or prompt_len < 1 or gen_len < 2:
        raise ValueError(f"batch and prompt_len must be positive and gen_len at least 2, got {batch}, "
                         f"{prompt_len}, {gen_len}")
    if mesh is not None:
        with jax.set_mesh(mesh):
            row = run_bench(model, batch, prompt_len, gen_len, run=run, rates=rates if mesh.size == 1 else None,
                            breakdown=breakdown, seed=seed, trace_dir=trace_dir)
        peaks = peak_memory(mesh.devices.flat)
        known = [p for p in peaks if p is not None]
        return row | {"mesh": dict(mesh.shape), "peak_memory_bytes": max(known) if known else None,
                      "peak_memory_bytes_per_device": peaks}
    cfg = model.cfg
    run = run.replace(slots=batch, max_len=prompt_len + gen_len)
    engine = Engine(model, run, programs=program_store())
    requests = _requests(cfg, batch, prompt_len, gen_len, seed)
    # Every program the run takes, in parallel (all requests start together: one prefill size).
    engine.precompile(modes=[SamplingModes.of([requests[0].sampling])], buckets=[prefill_rows(batch, batch)])
    if len(engine.widths) > 1:
        engine.measure_widths()
    _timed_run(engine, [dataclasses.replace(r, sampling=SamplingParams(temperature=0.0, max_tokens=2))
                        for r in requests])  # a first run of each step, outside the measurement
    compiled = Engine.compilations()
    acceptance = Acceptance(cfg.dspark_block_size) if engine.drafting else None
    prefill_s, decode_s, steps = _timed_run(engine, requests, acceptance)
    if Engine.compilations() != compiled:
        raise RuntimeError(f"the measured run compiled {Engine.compilations() - compiled} more programs after "
                           "warm-up: a step's shapes changed")
    out = {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "kv_dtype": run.kv_dtype or "bfloat16",
           "weights": "bf16" if cfg.quantization is None else "keep",
           "prefill_s": prefill_s, "prefill_tokens_per_s": batch * prompt_len / prefill_s,
           "decode_step_s": decode_s / steps, "decode_tokens_per_s_per_seq": steps / decode_s,
           "decode_tokens_per_s": batch * steps / decode_s, "decode_steps": steps,
           "peak_memory_bytes": peak_memory()[0], "compilations_after_warmup": 0}
    if acceptance is not None:  # the "steps" above are tokens per request; these are the verification steps
        out["speculative"] = {"drafts": run.drafts, "width_seconds": None if engine.width_seconds is None else
                              [float(x) for x in engine.width_seconds], **acceptance.summary()}
        breakdown = False  # the per-part split profiles the plain decode step, which a drafting run does not take
    if rates is not None:
        roof = (roofline_v41(model, batch, prompt_len, gen_len, rates, run.decoder_prefill, run.kv_dtype)
                if getattr(cfg, "family", "v4") == "v4.1" else roofline(model, batch, prompt_len, gen_len, rates,
                                                                         run.kv_dtype))
        out |= {f"roofline_{k}": v for k, v in roof.items()}
        out["decode_of_roofline"] = roof["decode_step_s"] / out["decode_step_s"]
        out["prefill_of_roofline"] = roof["prefill_s"] / prefill_s
    if breakdown:
        out["decode_parts_s"] = decode_breakdown(engine, batch, prompt_len, seed=seed, trace_dir=trace_dir)
        out["prefill_parts_s"] = prefill_breakdown(engine, batch, prompt_len, seed=seed,
                                                   trace_dir=trace_dir and os.path.join(trace_dir, "prefill"))
    return out


def _without_command_buffers(lowered: jax.stages.Lowered):
    """`lowered` compiled so that every GPU kernel carries its HLO instruction in a profiler trace: XLA
    otherwise replays runs of kernels as CUDA graphs, which the trace names only by their graph. Kernel
    times are the same."""
    if jax.default_backend() == "gpu":
        return lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
    return lowered.compile()


def prefill_chunks(engine: Engine, compiled, cache, prompts: np.ndarray):
    """Prefill `prompts [n, L]` into slots 0 … n − 1 of `cache` from position 0 through `compiled` (the
    engine's text-only prefill chunk of n rows, `Engine.lower_prefill`), chunk by chunk as
    `Engine.prefill` runs them; returns (cache, logits `[slots, vocab]`), the logits after each prompt."""
    n, length = prompts.shape
    c = engine.chunk_size
    logits = jnp.zeros((engine.num_slots, engine.cfg.vocab_size), jnp.float32)
    slots = jnp.arange(n, dtype=jnp.int32)
    for k in range(-(-length // c)):
        tokens = np.zeros((n, c), np.int32)
        part = prompts[:, k * c:(k + 1) * c]
        tokens[:, :part.shape[1]] = part
        start = jnp.full((n,), k * c, jnp.int32)
        n_valid = jnp.full((n,), part.shape[1], jnp.int32)
        ends = jnp.full((n,), (k + 1) * c >= length)
        cache, logits, _ = compiled(engine.params, cache, logits, jnp.asarray(tokens), slots, start, n_valid, ends,
                                    None)
    return cache, logits


def prefill_breakdown(engine: Engine, batch: int, prompt_len: int, seed: int = 0,
                      trace_dir: str | None = None) -> dict:
    """Seconds of each part (`attribute_trace`: attention, indexer scores, its top-k, MoE, the rest) in the
    whole prefill of `batch` random prompts of `prompt_len` tokens into an empty cache, chunk by chunk
    through the engine's prefill program; `chunks` says how many. {} on CPU (its traces have no kernel
    events). `trace_dir` keeps the profiler trace."""
    if jax.default_backend() == "cpu":
        return {}
    prompts = np.random.default_rng(seed).integers(0, engine.cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    compiled = _without_command_buffers(engine.lower_prefill(engine.new_cache(), batch))
    warm, _ = prefill_chunks(engine, compiled, engine.new_cache(), prompts[:, :engine.chunk_size])
    del warm  # the first run of the program, outside the trace
    cache = engine.new_cache()
    with tempfile.TemporaryDirectory() as tmp:
        d = trace_dir or tmp
        with jax.profiler.trace(d):
            jax.block_until_ready(prefill_chunks(engine, compiled, cache, prompts))
        return attribute_trace(d, compiled.as_text(), 1) | {"chunks": -(-prompt_len // engine.chunk_size)}


def decode_breakdown(engine: Engine, batch: int, context: int, steps: int = 8, seed: int = 0,
                     trace_dir: str | None = None) -> dict:
    """Per-step seconds of each part of the decode step (`attribute_trace`), from `steps` steps on a
    cache whose slots all hold `context` tokens, fed random tokens (the hash routers pick experts by
    token id: equal tokens would touch few experts). The sampler, a program of its own, is not in it.
    Cache contents are zeros: the work does not depend on them. `trace_dir` keeps the profiler trace (for
    Perfetto or TensorBoard)."""
    if jax.default_backend() == "cpu":  # XLA:CPU's traces have no kernel events to attribute
        return {}
    cache = engine.new_cache()
    cache = dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, context))
    rng = np.random.default_rng(seed)
    tokens = [jnp.asarray(rng.integers(0, engine.cfg.vocab_size, batch), jnp.int32) for _ in range(steps + 1)]
    active = jnp.ones((batch,), bool)
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * batch, [0] * batch)
    cache, _ = engine.decode(cache, tokens[-1], active, sampling)  # compiled already; warms the caches
    jax.block_until_ready(cache)
    lowered = engine.lower_decode(cache, tokens[0], active)
    compiled = _without_command_buffers(lowered)
    with tempfile.TemporaryDirectory() as tmp:
        d = trace_dir or tmp
        cache, _, _ = compiled(engine.params, cache, tokens[0], active)  # first run outside the trace
        with jax.profiler.trace(d):
            for t in tokens[:steps]:
                cache, logits, _ = compiled(engine.params, cache, t, active)
            jax.block_until_ready((cache, logits))
        return attribute_trace(d, compiled.as_text(), steps)


def format_report(row: dict) -> str:
    """A short human-readable summary of one `run_bench` row."""
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.1f} GiB"  # noqa: E731
    lines = [f"batch {row['batch']} × prompt {row['prompt_len']} + {row['gen_len']} generated "
             f"({row['weights']} weights, {row['kv_dtype']} cache)",
             f"  prefill  {row['prefill_tokens_per_s']:12,.0f} tokens/s   ({row['prefill_s'] * 1e3:.1f} ms)",
             f"  decode   {row['decode_tokens_per_s']:12,.1f} tokens/s   {row['decode_tokens_per_s_per_seq']:.1f} per "
             f"sequence, {row['decode_step_s'] * 1e3:.2f} ms per step",
             f"  peak device memory {gib(row['peak_memory_bytes'])}"
             + (f" (the largest of {len(row['peak_memory_bytes_per_device'])} devices: "
                f"{', '.join(gib(n) for n in row['peak_memory_bytes_per_device'])})"
                if any(n is not None for n in row.get("peak_memory_bytes_per_device", ())) else "")]
    spec = row.get("speculative")
    if spec and spec.get("target_steps"):
        rates = "/".join("-" if r is None else f"{100 * r:.0f}%" for r in spec["acceptance_by_position"])
        lines.insert(3, f"  DSpark   {spec['target_steps']} target steps, {spec['mean_accepted_length']:.2f} tokens per "
                        f"sequence a step, drafts accepted {rates} (a decode \"step\" above is a token)")
    if "mesh" in row:
        lines[0] += f" on mesh {','.join(f'{a}={n}' for a, n in row['mesh'].items())}"
    if "roofline_decode_step_s" in row:
        lines.append(f"  roofline decode {row['roofline_decode_step_s'] * 1e3:.3f} ms per step "
                     f"({row['roofline_decode_bound']} bound: {row['roofline_decode_step_bytes'] / 1e9:.2f} GB, "
                     f"{row['roofline_decode_step_flops'] / 1e12:.3f} TFLOP) → {100 * row['decode_of_roofline']:.1f}% "
                     f"reached; prefill {row['roofline_prefill_s'] * 1e3:.1f} ms → "
                     f"{100 * row['prefill_of_roofline']:.1f}%")
    lines += _parts_lines("decode step", row.get("decode_parts_s"), row["decode_step_s"])
    lines += _parts_lines("prefill", row.get("prefill_parts_s"), row["prefill_s"])
    return "\n".join(lines)


def _parts_lines(what: str, parts: dict | None, wall_s: float) -> list[str]:
    if parts is None:
        return []
    if not parts:
        return [f"  {what} by part: this backend's profiler trace has no device kernels"]
    busy = sum(parts.get(k, 0.0) for k in (*PARTS, "unattributed"))
    per = "step" if what.startswith("decode") else "prefill"
    lines = [f"  {what} by part (device kernels): " + ", ".join(
        f"{k} {parts[k] * 1e3:.3f} ms" for k in (*PARTS, "unattributed") if parts.get(k))
        + f"; {parts['kernels_per_step']:.0f} kernels per {per}, busy {busy * 1e3:.2f} of {wall_s * 1e3:.2f} ms"
        + (f" ({parts['chunks']} chunks)" if "chunks" in parts else "")
        + (f" (mean of {parts['devices']} devices)" if parts.get("devices", 1) > 1 else "")]
    for name, sec in parts.get("top_kernels", {}).items():
        lines.append(f"    {sec * 1e3:8.3f} ms  {name}")
    return lines


def bench(model: DeepseekV4, batches: Sequence[int], prompt_len: int, gen_len: int, *, run: RunConfig,
          breakdown: bool = True, rates: DeviceRates | None = None, seed: int = 0, trace_dir: str | None = None,
          mesh: jax.sharding.Mesh | None = None, emit=print) -> list[dict]:
    """`run_bench` for each batch size on one model (on `mesh`, if given), as `run` says with that many
    slots; `emit` receives each row as it is made; `trace_dir/batch<B>` keeps each breakdown's profiler
    trace."""
    cfg = model.cfg
    if prompt_len + gen_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt_len + gen_len = {prompt_len + gen_len} exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    if rates is None and (mesh is None or mesh.size == 1):  # a mesh of several devices has no roofline
        rates = measure_rates()
    rows = []
    for b in batches:
        row = run_bench(model, b, prompt_len, gen_len, run=run.replace(slots=b), rates=rates,
                        breakdown=breakdown, seed=seed, mesh=mesh,
                        trace_dir=os.path.join(trace_dir, f"batch{b}") if trace_dir else None)
        row |= {"layers": cfg.num_hidden_layers, "device": jax.devices()[0].device_kind}
        if rates is not None:
            row |= {"copy_TBps": rates.copy_bytes_per_s / 1e12, "matmul_TFLOPs": rates.matmul_flops_per_s / 1e12}
        rows.append(row)
        emit(row)
    return rows
