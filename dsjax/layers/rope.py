"""Rotary embeddings as V4 applies them: interleaved pairs on the trailing `rd` channels of each head.

Two tables exist, `main` (pure sliding layers) and `compress` (CSA/HCA attention, compressors, indexer);
only `compress` may carry YaRN. Frequencies are computed in fp32 numpy at trace time. The image encoders'
2-D tables (`rope_2d`) turn a patch's channels by its row and its column instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies `[rd/2]` (fp32), plain or YaRN-blended."""
    dim = rope.rope_dim(head_dim)
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exps, dtype=np.float32)
    extrap = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type != "yarn":
        return extrap
    factor = rope.factor
    interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    omax = rope.original_max_position_embeddings

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(omax / (n_rot * 2 * math.pi))) / (2 * math.log(rope.theta))

    # V4's rope dict has no top-level `truncate`, so the reference always truncates.
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrap_factor = (np.float32(1.0) - ramp).astype(np.float32)
    return (interp * (1 - extrap_factor) + extrap * extrap_factor).astype(np.float32)


def rope_table(rope: RopeConfig, head_dim: int, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[..., rd/2]` at integer `positions`, rounded to the activation dtype as the reference does."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rope, head_dim))
    scale = rope.scaling()
    return (jnp.cos(freqs) * scale).astype(dtype), (jnp.sin(freqs) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the trailing `2·len(cos)` channels of x in interleaved pairs; cos/sin broadcast over heads.

    x is `[..., S, (heads,) D]`-like with cos `[..., S, rd/2]` expanded by the caller to broadcast.
    Each pair (a, b) becomes (a·cos − b·sin, b·cos + a·sin), in fp32, cast back to x's dtype.
    """
    half = cos.shape[-1]
    rd = 2 * half
    nope, rot = x[..., :-rd], x[..., -rd:]
    pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos.astype(jnp.float32), sin.astype(jnp.float32)
    out = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(rot.shape).astype(x.dtype)
    return jnp.concatenate([nope, out], axis=-1)


def rope_2d(row: jax.Array, col: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """An image patch grid's rotary table: cos and sin `[..., head_dim/2]` for patch (row, col) ids of any
    shape; the first `head_dim/4` angles turn with the row, the last with the column, both at the
    frequencies `theta^(−i/(head_dim/4))`, in fp32."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (np.arange(quarter, dtype=np.float32) / quarter))
    angles = jnp.concatenate([row.astype(jnp.float32)[..., None] * inv, col.astype(jnp.float32)[..., None] * inv],
                             axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate all channels of x in the half-split (NeoX) form: channel i pairs with i + D/2; cos/sin
    `[..., D/2]` broadcast over heads by the caller. In fp32, cast back to x's dtype."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos.astype(jnp.float32), sin.astype(jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
