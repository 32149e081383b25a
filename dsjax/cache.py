"""The V4 cache: fixed-shape device arrays for `num_slots` sequences of up to `max_len` tokens.

Per layer it holds
- `window [B, W, D]`: the last W = sliding_window shared K=V vectors, a ring indexed by position % W;
- for CSA/HCA layers a `CompressorState`: the raw kv/gate projections of the current partial window
  (a ring of m tokens), for CSA the previous complete window's Ca half (the overlap), and the
  compressed entries `[B, max_len // m, width]`;
- for CSA layers a second `CompressorState` for the lightning indexer's keys.
Entry counts are never stored: a slot of length L has exactly L // m entries. The cache mirrors the
model's layer groups (stacked over each group's repeats) so one `lax.scan` walks weights and cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.config import CSA, HCA, SLIDING, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressorState:
    buffer_kv: jax.Array  # [B, m, n] raw kv of the partial window, slot = position % m
    buffer_gate: jax.Array  # [B, m, n] raw gate (position_bias not yet added)
    entries: jax.Array  # [B, max_len // m, width]
    overlap_kv: jax.Array | None = None  # CSA: [B, m, width] Ca kv of the last complete window
    overlap_gate: jax.Array | None = None  # CSA: [B, m, width] its raw Ca gate


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    window: jax.Array  # [B, W, D]
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


def _compressor_state(b: int, rate: int, width: int, overlap: bool, max_len: int, dtype) -> CompressorState:
    n = 2 * width if overlap else width
    z = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    return CompressorState(
        buffer_kv=z(b, rate, n), buffer_gate=z(b, rate, n), entries=z(b, max_len // rate, width),
        overlap_kv=z(b, rate, width) if overlap else None, overlap_gate=z(b, rate, width) if overlap else None)


def layer_cache(cfg: ModelConfig, attention_type: str, num_slots: int, max_len: int, dtype) -> LayerCache:
    window = jnp.zeros((num_slots, cfg.sliding_window, cfg.head_dim), dtype)
    if attention_type == SLIDING:
        return LayerCache(window)
    if attention_type == HCA:
        return LayerCache(window, _compressor_state(num_slots, cfg.compress_rate_hca, cfg.head_dim, False,
                                                    max_len, dtype))
    m = cfg.compress_rate_csa
    return LayerCache(window, _compressor_state(num_slots, m, cfg.head_dim, True, max_len, dtype),
                      _compressor_state(num_slots, m, cfg.index_head_dim, True, max_len, dtype))


def init_cache(model, num_slots: int, max_len: int, dtype=None) -> Cache:
    """An empty cache for `model` (a DeepseekV4); `dtype` defaults to the model's activation dtype."""
    cfg = model.cfg
    dtype = dtype or model.dtype
    groups = []
    for meta in model.groups_meta:
        per_position = []
        for attention_type, _ in meta.pattern:
            one = layer_cache(cfg, attention_type, num_slots, max_len, dtype)
            per_position.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (meta.repeats, *x.shape)), one))
        groups.append(tuple(per_position))
    return Cache(lengths=jnp.zeros((num_slots,), jnp.int32), groups=tuple(groups))


def cache_bytes_per_token(cfg: ModelConfig, max_len: int, dtype=jnp.bfloat16) -> dict[str, float]:
    """Cache bytes per token of context, per layer type, for one sequence of `max_len` tokens
    (fixed-size parts such as the window ring are spread over max_len)."""
    out = {}
    for t in sorted(set(cfg.layer_types)):
        one = jax.eval_shape(lambda t=t: layer_cache(cfg, t, 1, max_len, dtype))
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))
        out[t] = total / max_len
    return out
