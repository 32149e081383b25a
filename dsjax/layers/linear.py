"""Linear maps stored as in the checkpoint: weight `[out, in]`, y = x·Wᵀ.

With a `QuantConfig` the weight stays FP8 (e4m3) on the device next to its block scales
(`weight_scale_inv`, a multiplier despite the name) and is dequantized inside the traced computation,
one layer at a time, so no full-precision copy of the model is ever held; at decode a GPU kernel can
read the codes instead (`kernels.expert_matmul.op.dense_fp8_matmul`, where `DENSE_MAX_ROWS` allows).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import QuantConfig
from dsjax.kernels.expert_matmul.op import dense_fp8_matmul
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
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
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

    def _fp8_groups(self, x_gpk: jax.Array, plain: Callable[[], jax.Array]) -> jax.Array:
        """`[G, P, K] → [G, P, out/G]` through `dense_fp8_matmul`, the stored weight cut into G linears;
        `plain()` is the same product as this module computes it without a kernel (its exact numbers)."""
        g, _, k = x_gpk.shape
        w, s = self.weight[...], self.weight_scale_inv[...]
        if g > 1 and (w.shape[0] // g) % self.block[0]:  # a group's rows would split a scale block
            return plain()
        return dense_fp8_matmul(x_gpk, w.reshape(g, -1, k), s.reshape(g, -1, s.shape[-1]), self.block,
                                kernels=self.kernels, reference=plain)


class Linear(_StoredWeight):
    """`y = x·Wᵀ (+ b)` with W `[out, in]`; computed in the input dtype."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, std: float = 0.02, quant: QuantConfig | None = None,
                 axes: tuple[str | None, str | None] | None = None):
        self._init_weight(rngs, (out_features, in_features), dtype, std, quant, axes)
        meta = {} if axes is None else {"axes": tuple(axes[:1])}
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), **meta) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        def plain():
            return einsum("...i,oi->...o", x, self.dense_weight(x.dtype))

        if self.block is None:
            y = plain()
        else:
            y = self._fp8_groups(x.reshape(1, -1, x.shape[-1]), lambda: plain().reshape(1, -1, self.weight.shape[0]))
            y = y.reshape(*x.shape[:-1], -1)
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
        def plain():
            w = self.dense_weight(x_bsgi.dtype)
            return einsum("...gi,gri->...gr", x_bsgi, w.reshape(self.groups, -1, w.shape[-1]))

        if self.block is None:
            return plain()
        lead, (g, k) = x_bsgi.shape[:-2], x_bsgi.shape[-2:]
        x_gpk = jnp.moveaxis(x_bsgi.reshape(-1, g, k), 1, 0)
        y_gpr = self._fp8_groups(x_gpk, lambda: jnp.moveaxis(plain().reshape(-1, g, self.weight.shape[0] // g), 1, 0))
        return jnp.moveaxis(y_gpr, 0, 1).reshape(*lead, g, -1)
