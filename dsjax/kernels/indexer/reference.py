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

    def head(score_bct, qw):
        # One head at a time: the temporaries stay [B, C, T] (a [B, C, heads, T] product would take
        # 550 GB for a chunk of 8,192 queries at 1M tokens of context).
        q_bcd, w_bc = qw
        dots_bct = jnp.einsum("bcd,btd->bct", q_bcd.astype(f32), keys_btc, precision=exact)
        return score_bct + jax.nn.relu(dots_bct) * scale * w_bc.astype(f32)[..., None], None

    b, c_len = q_bchc.shape[:2]
    zeros = jnp.zeros((b, c_len, keys_btc.shape[1]), f32)
    score_bct, _ = jax.lax.scan(head, zeros, (jnp.moveaxis(q_bchc, 2, 0), jnp.moveaxis(weights_bch, 2, 0)))
    visible_bct = jnp.arange(score_bct.shape[-1]) < keys_len_bc[..., None]
    return jnp.where(visible_bct, score_bct, -jnp.inf)


def index_scores_reference(q_bhc: jax.Array, weights_bh: jax.Array, keys: jax.Array | PackedKV,
                           keys_len_b: jax.Array, scale: float) -> jax.Array:
    """`[B, T]`: `index_scores_chunk_reference` of one query per slot."""
    return index_scores_chunk_reference(q_bhc[:, None], weights_bh[:, None], keys, keys_len_b[:, None], scale)[:, 0]
