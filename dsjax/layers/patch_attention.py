"""Bidirectional attention over the patches of images, for the image encoders: every patch of an image
attends every valid patch of the same image, with a softmax in fp32. Images travel as a batch `[B, N, …]`
of one padded length; a patch is valid when it belongs to its image (padding patches are keys of no one).

Two forms: `attend`, blocked XLA attention for every platform, and `attend_fused`, cuDNN's fused (flash)
attention on NVIDIA GPUs, which holds no score matrix in memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.numerics import einsum

# Queries per block of `attend`: a block's fp32 scores are B·heads·QUERY_BLOCK·N, not B·heads·N² (4.9 GB per
# layer for the 8,712 patches of a 1848×924 image at 16 heads, 0.57 GB in blocks of 1024), so encoding
# images fits beside a decoder that fills the device.
QUERY_BLOCK = 1024


def _attend_dense(q_bqhk: jax.Array, k_bnhk: jax.Array, v_bnhk: jax.Array, valid_bn: jax.Array) -> jax.Array:
    scores_bhqn = einsum("bqhk,bnhk->bhqn", q_bqhk, k_bnhk).astype(jnp.float32) * (q_bqhk.shape[-1] ** -0.5)
    scores_bhqn = jnp.where(valid_bn[:, None, None, :], scores_bhqn, -jnp.inf)
    probs_bhqn = jax.nn.softmax(scores_bhqn, axis=-1).astype(v_bnhk.dtype)
    return einsum("bhqn,bnhk->bqhk", probs_bhqn, v_bnhk)


def attend(q_bnhk: jax.Array, k_bnhk: jax.Array, v_bnhk: jax.Array, valid_bn: jax.Array,
           query_block: int = QUERY_BLOCK) -> jax.Array:
    """Every patch's attention over its image's valid patches `[B, N, heads, head_dim]`. Past `query_block`
    patches the queries go in blocks of that many (the last one padded), one block after another, each
    over every key: the same sums per query, a block's scores at a time."""
    b, n = q_bnhk.shape[:2]
    if n <= query_block:
        return _attend_dense(q_bnhk, k_bnhk, v_bnhk, valid_bn)
    blocks = -(-n // query_block)
    q_xbqhk = jnp.moveaxis(jnp.pad(q_bnhk, ((0, 0), (0, blocks * query_block - n), (0, 0), (0, 0))).reshape(
        b, blocks, query_block, *q_bnhk.shape[2:]), 1, 0)
    out_xbqhk = jax.lax.map(lambda q_bqhk: _attend_dense(q_bqhk, k_bnhk, v_bnhk, valid_bn), q_xbqhk)
    return jnp.moveaxis(out_xbqhk, 0, 1).reshape(b, blocks * query_block, *q_bnhk.shape[2:])[:, :n]


def fused_attention_fits(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes these heads: half-precision operands, at most 128 channels,
    a multiple of 8."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim <= 128 \
        and head_dim % 8 == 0


def attend_fused(q_bnhk: jax.Array, k_bnhk: jax.Array, v_bnhk: jax.Array, n_valid_b: jax.Array) -> jax.Array:
    """`attend` through cuDNN's fused attention, on NVIDIA GPUs only. The first `n_valid_b` patches of each
    image must be its valid ones: cuDNN masks keys by a sequence length."""
    return jax.nn.dot_product_attention(q_bnhk, k_bnhk, v_bnhk, key_value_seq_lengths=n_valid_b.astype(jnp.int32),
                                        implementation="cudnn")


def valid_first(valid_bn: jax.Array) -> jax.Array:
    """Per image, the order `[B, N]` that puts its valid patches first (stable), as `attend_fused` needs."""
    return jnp.argsort(~valid_bn, axis=-1, stable=True)
