"""RMSNorm in the two forms V4 uses: weighted (a learned fp32 scale) and unweighted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """`x * rsqrt(mean(x²) + eps)`, statistics in fp32, the factor cast to x's dtype before the multiply."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weighted RMSNorm: normalise and scale in fp32, cast once to the input dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)
