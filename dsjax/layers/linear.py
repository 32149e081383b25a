"""Linear maps stored as in the checkpoint: weight `[out, in]`, y = x·Wᵀ.

With a `QuantConfig` the weight stays FP8 (e4m3) on the device next to its block scales
(`weight_scale_inv`, a multiplier despite the name) and is dequantized inside the traced computation,
one layer at a time, so no full-precision copy of the model is ever held.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import QuantConfig
from dsjax.numerics import einsum
from dsjax.layers.variables import Buffer
from dsjax.quant import dequantize_fp8, quantize_fp8


def _normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def scale_dtype(quant: QuantConfig):
    """How scales are held: the ue8m0 byte (uint8) or fp32."""
    return jnp.uint8 if quant.scale_fmt == "ue8m0" else jnp.float32


def quantize_weight(w, quant: QuantConfig):
    """A float `[..., out, in]` weight → (e4m3 weight, block scales in the config's scale format)."""
    return quantize_fp8(w, tuple(quant.weight_block_size), quant.scale_fmt)


class _StoredWeight(nnx.Module):
    """A `[out, in]` weight kept either in a float dtype or as FP8 blocks with scales."""

    def _init_weight(self, rngs, shape, dtype, std, quant: QuantConfig | None, axes):
        """`axes`: the logical names of (out, in), for the sharding rules (None: replicated); the block
        scales' grid carries the same names."""
        self.block = None if quant is None else tuple(quant.weight_block_size)
        meta = {} if axes is None else {"axes": tuple(axes)}
        if quant is None:
            self.weight = nnx.Param(_normal(rngs, shape, dtype, std), **meta)
            return
        q, s = quantize_weight(_normal(rngs, shape, jnp.float32, std), quant)
        self.weight = nnx.Param(q, **meta)
        self.weight_scale_inv = Buffer(s, **meta)

    def dense_weight(self, dtype) -> jax.Array:
        """The weight in `dtype` (dequantized in fp32 then cast, as the reference does at load)."""
        if self.block is None:
            return self.weight[...].astype(dtype)
        return dequantize_fp8(self.weight[...], self.weight_scale_inv[...], dtype, self.block)


class Linear(_StoredWeight):
    """`y = x·Wᵀ (+ b)` with W `[out, in]`; computed in the input dtype."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, std: float = 0.02, quant: QuantConfig | None = None,
                 axes: tuple[str | None, str | None] | None = None):
        self._init_weight(rngs, (out_features, in_features), dtype, std, quant, axes)
        meta = {} if axes is None else {"axes": tuple(axes[:1])}
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), **meta) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = einsum("...i,oi->...o", x, self.dense_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class GroupedLinear(_StoredWeight):
    """Block-diagonal linear over G groups of one stored weight `[G·r, in/G]`: `[..., G, in/G] -> [..., G, r]`.

    FP8 blocks tile the stored 2-D weight, as the reference's per-group view of them does."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, std: float = 0.02, quant: QuantConfig | None = None,
                 axes: tuple[str | None, str | None] | None = None):
        self.groups = groups
        self._init_weight(rngs, (out_features, in_per_group), dtype, std, quant, axes)

    def __call__(self, x_bsgi: jax.Array) -> jax.Array:
        w = self.dense_weight(x_bsgi.dtype)
        w_gri = w.reshape(self.groups, -1, w.shape[-1])
        return einsum("...gi,gri->...gr", x_bsgi, w_gri)
