"""The pure-JAX reference of the lightning indexer's scores (and the fallback on backends without a
kernel): `score[b, c, t] = scale · Σ_h w[b, c, h] · relu(q[b, c, h] · k[b, t])` of each of a chunk's C
queries over its slot's first `keys_len[b, c]` index keys, −inf past them; decode is one query per
slot. Everything in fp32 from the (bf16 or fp32) queries and the dequantized keys on, as
`layers.indexer.IndexerScorer` computes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.cache import read_rows
from dsjax.quant import PackedKV


def index_scores_chunk_reference(q_bchc: jax.Array, weights_bch: jax.Array, keys: jax.Array | PackedKV,
                                 keys_len_bc: jax.Array, scale: float) -> jax.Array:
    """`[B, C, T]` fp32 scores of the slot's index keys `keys [B, T, c]` (array or fp8 PackedKV) for C
    queries per slot; −inf for `t ≥ keys_len[b, c]`."""
    f32, exact = jnp.float32, jax.lax.Precision.HIGHEST
    keys_btc = read_rows(keys, f32)
    dots_bcht = jnp.einsum("bchd,btd->bcht", q_bchc.astype(f32), keys_btc, precision=exact)
    score_bct = jnp.einsum("bcht,bch->bct", jax.nn.relu(dots_bcht) * scale, weights_bch.astype(f32), precision=exact)
    visible_bct = jnp.arange(score_bct.shape[-1]) < keys_len_bc[..., None]
    return jnp.where(visible_bct, score_bct, -jnp.inf)


def index_scores_reference(q_bhc: jax.Array, weights_bh: jax.Array, keys: jax.Array | PackedKV,
                           keys_len_b: jax.Array, scale: float) -> jax.Array:
    """`[B, T]`: `index_scores_chunk_reference` of one query per slot."""
    return index_scores_chunk_reference(q_bhc[:, None], weights_bh[:, None], keys, keys_len_b[:, None], scale)[:, 0]
