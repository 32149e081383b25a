"""The indexer's top-k pick: each query's k best-scored entries, exactly as one `lax.top_k` over all of
them picks (ties to the lower index), in two small selections instead of one over every entry.

At long context a query scores T entries (262,144 at 1M tokens) and keeps k = 512; a top-k over the
whole row is a sort of it on GPUs, once per query. Instead: cut the row into blocks of `block`
entries, take the k blocks with the largest maxima (a pick of its own, made the same way when there are
many blocks), then the k best of those k·block entries. The k best entries lie in those blocks: each block outside them has a maximum no larger than k other
blocks' maxima, all distinct entries, so none of its entries can rank above k others. With ties, the
lower block index wins the first selection and the candidates keep index order, so the lower entry
index wins the second, as in the one-step pick.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def pick_block(t: int, k: int) -> int:
    """Entries per block for rows of t scores: the power of two nearest √(t / k), which balances the two
    selections (t / block block maxima, k · block candidates); 1 (a single selection) for short rows."""
    if k == 0 or t < 8 * k:
        return 1
    return 1 << max(0, round(math.log2(math.sqrt(t / k))))


def score_blocks(score: jax.Array, block: int) -> jax.Array:
    """`[..., T]` scores → `[..., ⌈T/block⌉, block]`, the last block padded with −inf."""
    t = score.shape[-1]
    n_blocks = -(-t // block)
    padded = jnp.pad(score, ((0, 0),) * (score.ndim - 1) + ((0, n_blocks * block - t),), constant_values=-jnp.inf)
    return padded.reshape(*score.shape[:-1], n_blocks, block)


def top_picks(score_bst: jax.Array, k: int, block: int | None = None) -> jax.Array:
    """The top `min(k, T)` entries per query `[..., k]` as indices in increasing order, −1 (at the end)
    where the score is −inf; `block` as `pick_block` chooses by default."""
    t = score_bst.shape[-1]
    k = min(k, t)
    block = pick_block(t, k) if block is None else block
    n_blocks = -(-t // block)
    if block <= 1 or n_blocks <= k:
        top, idx = jax.lax.top_k(score_bst, k)
    else:
        lead = score_bst.shape[:-1]
        blocks = score_blocks(score_bst, block)
        # The k blocks by maximum are themselves a pick of k among n_blocks scores, made the same way
        # (in index order, −1 for blocks of −inf only); candidates in index order send ties to the lower index.
        chosen = top_picks(jnp.max(blocks, axis=-1), k)
        candidates = jnp.take_along_axis(blocks, jnp.maximum(chosen, 0)[..., None], axis=-2)
        candidates = jnp.where(chosen[..., None] >= 0, candidates, -jnp.inf).reshape(*lead, k * block)
        top, pos = jax.lax.top_k(candidates, k)
        idx = jnp.take_along_axis(chosen, pos // block, axis=-1) * block + pos % block
    idx = jnp.where(top > -jnp.inf, idx, t)  # invalid picks sort last
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx < t, idx, -1).astype(jnp.int32)
