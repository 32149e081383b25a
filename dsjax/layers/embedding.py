"""A lookup table `[vocab, dim]`: row `id` for each id (ids past the table clip to its last row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (vocab, dim))).astype(dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0, mode="clip")
