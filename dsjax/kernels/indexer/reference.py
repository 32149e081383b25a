"""The pure-JAX reference of the lightning indexer's decode scores (and the fallback on backends without
a kernel): `score[b, t] = Σ_h w[b, h] · relu(q[b, h] · k[b, t])` over the slot's first `keys_len[b]`
index keys, −inf past them. Everything in fp32 from the (bf16 or fp32) queries and the dequantized
keys on, as `layers.indexer.IndexerScorer` computes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.cache import read_rows
from dsjax.quant import PackedKV


def index_scores_reference(q_bhc: jax.Array, weights_bh: jax.Array, keys: jax.Array | PackedKV,
                           keys_len_b: jax.Array, scale: float) -> jax.Array:
    """`[B, T]` fp32 scores of the slot's index keys `keys [B, T, c]` (array or fp8 PackedKV) for one
    query per slot: `scale · Σ_h weights[b, h] · relu(q[b, h] · k[b, t])`, −inf for `t ≥ keys_len[b]`."""
    f32 = jnp.float32
    keys_btc = read_rows(keys, f32)
    dots_bht = jnp.einsum("bhc,btc->bht", q_bhc.astype(f32), keys_btc, precision=jax.lax.Precision.HIGHEST)
    score_bt = jnp.einsum("bht,bh->bt", jax.nn.relu(dots_bht) * scale, weights_bh.astype(f32),
                          precision=jax.lax.Precision.HIGHEST)
    visible_bt = jnp.arange(score_bt.shape[1])[None, :] < keys_len_b[:, None]
    return jnp.where(visible_bt, score_bt, -jnp.inf)
