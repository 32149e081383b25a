"""Linear maps stored as in the checkpoint: weight `[out, in]`, y = x·Wᵀ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from dsjax.layers.numerics import einsum


def _normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """`y = x·Wᵀ (+ b)` with W `[out, in]`; computed in the input dtype."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, std: float = 0.02):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype, std))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class GroupedLinear(nnx.Module):
    """Block-diagonal linear over G groups of one stored weight `[G·r, in/G]`: `[..., G, in/G] -> [..., G, r]`."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, std: float = 0.02):
        self.groups = groups
        self.weight = nnx.Param(_normal(rngs, (out_features, in_per_group), dtype, std))

    def __call__(self, x_bsgi: jax.Array) -> jax.Array:
        w = self.weight[...].astype(x_bsgi.dtype)
        w_gri = w.reshape(self.groups, -1, w.shape[-1])
        return einsum("...gi,gri->...gr", x_bsgi, w_gri)
