"""The V4 cache: fixed-shape device arrays for `num_slots` sequences of up to `max_len` tokens.

Per layer it holds
- `window [B, W, D]`: the last W = sliding_window shared K=V vectors, a ring indexed by position % W;
- for CSA/HCA layers a `CompressorState`: the raw kv/gate projections of the current partial window
  (a ring of m tokens), for CSA the previous complete window's Ca half (the overlap), and the
  compressed entries `[B, max_len // m, width]`;
- for CSA layers a second `CompressorState` for the lightning indexer's keys.
Entry counts are never stored: a slot of length L has exactly L // m entries.

The cache mirrors the model's layer groups (stacked over each group's repeats) so one `lax.scan` walks
weights and cache.

`kv_dtype` "fp8" or "fp4" stores the window and the compressed entries as `PackedKV` (codes + scales,
rotary slice bf16) and the indexer's keys as fp8; the partial-window buffers stay in the float dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.config import HCA, SLIDING, ModelConfig
from dsjax.quant import INDEX_FP8_GROUP, KV_DTYPES, KV_FP8_GROUP, PackedKV, empty_kv, pack_kv, unpack_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressorState:
    buffer_kv: jax.Array  # [B, m, n] raw kv of the partial window, slot = position % m
    buffer_gate: jax.Array  # [B, m, n] raw gate (position_bias not yet added)
    entries: jax.Array | PackedKV  # [B, max_len // m, width]
    overlap_kv: jax.Array | None = None  # CSA: [B, m, width] Ca kv of the last complete window
    overlap_gate: jax.Array | None = None  # CSA: [B, m, width] its raw Ca gate


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    window: jax.Array | PackedKV  # [B, W, D]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    lengths: jax.Array  # [B] tokens already in each slot
    groups: tuple  # per layer group, per pattern position: a LayerCache stacked over the group's repeats

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]


def kv_rows(shape, dtype, kv_dtype: str | None, rope_dim: int, group: int = KV_FP8_GROUP):
    """Zeroed cache rows: a float array, or PackedKV for kv_dtype "fp8"/"fp4"."""
    if kv_dtype in (None, "bfloat16"):
        return jnp.zeros(shape, jnp.bfloat16 if kv_dtype else dtype)
    return empty_kv(shape, kv_dtype, rope_dim, group)


def read_rows(stored, dtype) -> jax.Array:
    """Cache rows as `dtype` values."""
    return unpack_kv(stored, dtype) if isinstance(stored, PackedKV) else stored.astype(dtype)


def as_rows(x: jax.Array, like):
    """New rows `x` in the storage of `like` (to be written into it)."""
    if isinstance(like, PackedKV):
        return pack_kv(x, like.fmt, like.rope.shape[-1], like.group)
    return x.astype(like.dtype)


def _compressor_state(b: int, rate: int, width: int, overlap: bool, max_len: int, dtype, kv_dtype, rope_dim,
                      group=KV_FP8_GROUP) -> CompressorState:
    n = 2 * width if overlap else width
    z = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return CompressorState(
        buffer_kv=z(b, rate, n), buffer_gate=z(b, rate, n),
        entries=kv_rows((b, max_len // rate, width), dtype, kv_dtype, rope_dim, group),
        overlap_kv=z(b, rate, width) if overlap else None, overlap_gate=z(b, rate, width) if overlap else None)


def layer_cache(cfg: ModelConfig, attention_type: str, num_slots: int, max_len: int, dtype,
                kv_dtype: str | None = None) -> LayerCache:
    """One layer's empty cache. `kv_dtype` None keeps rows in `dtype`; "bfloat16", "fp8" or "fp4" as the
    module docstring says."""
    if kv_dtype not in (None, *KV_DTYPES):
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    rd_window = cfg.rope_for(attention_type).rope_dim(cfg.head_dim)
    rd_entries = cfg.rope_compress.rope_dim(cfg.head_dim)
    window = kv_rows((num_slots, cfg.sliding_window, cfg.head_dim), dtype, kv_dtype, rd_window)
    if attention_type == SLIDING:
        return LayerCache(window)
    if attention_type == HCA:
        return LayerCache(window, _compressor_state(num_slots, cfg.compress_rate_hca, cfg.head_dim, False,
                                                    max_len, dtype, kv_dtype, rd_entries))
    m = cfg.compress_rate_csa
    index_kv = "fp8" if kv_dtype in ("fp8", "fp4") else kv_dtype
    index_group = min(INDEX_FP8_GROUP, cfg.index_head_dim)
    return LayerCache(window, _compressor_state(num_slots, m, cfg.head_dim, True, max_len, dtype, kv_dtype,
                                                rd_entries),
                      _compressor_state(num_slots, m, cfg.index_head_dim, True, max_len, dtype, index_kv, 0,
                                        index_group))


def init_cache(model, num_slots: int, max_len: int, dtype=None, kv_dtype: str | None = None) -> Cache:
    """An empty cache for `model` (a DeepseekV4); `dtype` (of the float parts) defaults to the model's
    activation dtype; `kv_dtype` as in `layer_cache`."""
    cfg = model.cfg
    dtype = dtype or model.dtype
    groups = []
    for meta in model.groups_meta:
        per_position = []
        for attention_type, _ in meta.pattern:
            one = layer_cache(cfg, attention_type, num_slots, max_len, dtype, kv_dtype)
            per_position.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (meta.repeats, *x.shape)), one))
        groups.append(tuple(per_position))
    return Cache(lengths=jnp.zeros((num_slots,), jnp.int32), groups=tuple(groups))


def cache_bytes_per_token(cfg: ModelConfig, max_len: int, dtype=jnp.bfloat16,
                          kv_dtype: str | None = None) -> dict[str, float]:
    """Cache bytes per token of context, per layer type, for one sequence of `max_len` tokens
    (fixed-size parts such as the window ring are spread over max_len)."""
    out = {}
    for t in sorted(set(cfg.layer_types)):
        one = jax.eval_shape(lambda t=t: layer_cache(cfg, t, 1, max_len, dtype, kv_dtype))
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))
        out[t] = total / max_len
    return out
