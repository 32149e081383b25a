"""Routed experts (dropless grouped matmul) and the shared expert, both SwiGLU with V4's clamp."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig, QuantConfig
from dsjax.layers.linear import Linear
from dsjax.layers.variables import Buffer
from dsjax.kernels.expert_matmul.op import expert_matmul
from dsjax.kernels.expert_matmul.reference import dequantized
from dsjax.kernels.grouped_dot import grouped_dot
from dsjax.quant import quantize_fp4, quantize_fp8, ue8m0_to_float
from dsjax.stacked import READ_IN_PLACE, StackedSlice, as_array


EXPERT_LEAVES = ("gate_up_proj", "down_proj")  # the stacked expert weights `RoutedExperts` holds


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """`silu(min(gate, limit)) · clip(up, −limit, limit)`: the gate is clamped from above only."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def quantize_experts(w_eio: jax.Array, quant: QuantConfig):
    """Float experts `[..., E, in, out]` → the checkpoint's `[..., E, out, in]` storage (FP8 blocks or
    packed FP4) and its scales in the config's scale format."""
    w = jnp.swapaxes(jnp.asarray(w_eio, jnp.float32), -1, -2)
    if quant.expert_dtype == "fp4":
        q, s = quantize_fp4(w)
    else:
        q, s = quantize_fp8(w, tuple(quant.weight_block_size), quant.scale_fmt)
    return q, (ue8m0_to_float(s) if s.dtype == jnp.uint8 and quant.scale_fmt == "float" else s)


class RoutedExperts(nnx.Module):
    """E experts as two stacked weights in `[E, in, out]` layout (the HF tensors transposed), so that
    `tokamax.ragged_dot` (a Pallas kernel on GPU/TPU, XLA's ragged_dot on CPU) reads them as stored.

    `gate_up_proj [E, H, 2I]`: columns [:I] are the gate (w1), [I:] the up projection (w3).
    `down_proj [E, I, H]`.

    A quantized config keeps the checkpoint's `[E, out, in]` storage instead, FP8 blocks or FP4 (int8,
    two codes per byte along `in`), with `*_scale_inv`. The grouped matmul takes them as stored
    (`kernels/expert_matmul`): on GPUs a kernel reads only the touched experts' codes; elsewhere, and
    for many rows per expert, the experts are dequantized first.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        # The grouped matmul is tokamax's, whose import registers jax config options that are part of jax's
        # tracing context: imported inside a program's first trace, it makes every jitted step trace and
        # compile again on its second call. So it is imported when a model is built, before any trace.
        import tokamax  # noqa: F401

        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.kernels = "auto"  # a run option (`dsjax.model.with_kernels`)
        self.code_layout = "checkpoint"  # FP4 codes as stored, or repacked for the kernels (`model.with_code_layout`)
        quant = cfg.quantization
        self.storage = None if quant is None else quant.expert_dtype
        for name, (d_in, d_out), axes_io in zip(EXPERT_LEAVES, ((h, 2 * i), (i, h)),
                                                (("embed", "ffn"), ("ffn", "embed"))):
            key = rngs.params()
            if quant is None:
                w = 0.02 * jax.random.normal(key, (e, d_in, d_out))
                setattr(self, name, nnx.Param(w.astype(dtype), axes=("expert", *axes_io)))
                continue
            # One expert at a time: quantizing all E at once held several float32 copies of them
            # (V4-Flash's gate_up: 17 GB each), which set `dsjax bench --weights fp8`'s peak memory.
            q, s = jax.lax.map(lambda k: quantize_experts(0.02 * jax.random.normal(k, (d_in, d_out)), quant),
                               jax.random.split(key, e))
            axes_oi = ("expert", *axes_io[::-1])  # stored [E, out, in], and so is the scale grid
            # The expert kernel reads a layer group's stacked codes in place (`dsjax.stacked`).
            setattr(self, name, nnx.Param(q, axes=axes_oi, **{READ_IN_PLACE: True}))
            setattr(self, f"{name}_scale_inv", Buffer(s, axes=axes_oi, **{READ_IN_PLACE: True}))

    def stored(self, name: str) -> tuple[jax.Array | StackedSlice, jax.Array | StackedSlice | None]:
        """`gate_up_proj` or `down_proj` as stored, with its scales (None for float experts); inside a
        layer group's scan, quantized ones are `StackedSlice`s."""
        scale = getattr(self, f"{name}_scale_inv")[...] if self.storage is not None else None
        return getattr(self, name)[...], scale

    def expert_weights(self, name: str, dtype) -> jax.Array:
        """`gate_up_proj` or `down_proj` as `[E, in, out]` in `dtype`."""
        return dense_experts(*self.stored(name), self.storage, self.cfg, dtype, self.code_layout)

    def __call__(self, x_nh: jax.Array, weights_nk: jax.Array, idx_nk: jax.Array) -> jax.Array:
        """`Σ_k weight[n,k] · expert_{idx[n,k]}(x[n])`: pairs sorted by expert, two grouped matmuls."""
        return grouped_mlp(x_nh, weights_nk, idx_nk,
                           *(matmul_experts(*self.stored(name), self.storage, self.cfg, self.code_layout)
                             for name in EXPERT_LEAVES), self.cfg, kernels=self.kernels)


def dense_experts(w: jax.Array | StackedSlice, scale: jax.Array | StackedSlice | None, storage: str | None,
                  cfg: ModelConfig, dtype, code_layout: str = "checkpoint") -> jax.Array:
    """Stacked expert weights as stored (float `[E, in, out]`, or FP8/FP4 `[E, out, in]` with scales, FP4
    codes in `code_layout`) → `[E, in, out]` in `dtype`. Works on any slice of the expert axis."""
    if storage is None:
        return as_array(w).astype(dtype)
    return dequantized(as_array(w), as_array(scale), storage, dtype, tuple(cfg.quantization.weight_block_size),
                       code_layout)


@dataclasses.dataclass(frozen=True)
class StoredExperts:
    """Stacked experts as a quantized checkpoint stores them, for the grouped matmul: `w [E, out, in]`
    e4m3 (or `[E, out, in/2]` packed e2m1, its codes in `code_layout`) and its scales. Any slice of the
    expert axis."""

    w: jax.Array | StackedSlice
    scale: jax.Array | StackedSlice
    storage: str
    block: tuple[int, int]
    code_layout: str = "checkpoint"

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(E, in, out)`, as a float `[E, in, out]` array of the same experts has."""
        e, out, width = self.w.shape
        return e, width * (2 if self.storage == "fp4" else 1), out


def matmul_experts(w: jax.Array | StackedSlice, scale: jax.Array | StackedSlice | None, storage: str | None,
                   cfg: ModelConfig, code_layout: str = "checkpoint") -> jax.Array | StoredExperts:
    """Experts as stored → the operand `grouped_mlp` takes: float experts as they are (`[E, in, out]`),
    quantized ones as `StoredExperts` (never dequantized whole where a kernel reads them)."""
    if storage is None:
        return as_array(w)
    return StoredExperts(w, scale, storage, tuple(cfg.quantization.weight_block_size), code_layout)


def _grouped_matmul(x_ph: jax.Array, experts: jax.Array | StoredExperts, group_sizes: jax.Array,
                    kernels: str) -> jax.Array:
    if isinstance(experts, StoredExperts):
        return expert_matmul(x_ph, experts.w, experts.scale, group_sizes, experts.storage, experts.block,
                             code_layout=experts.code_layout, kernels=kernels)
    return grouped_dot(x_ph, experts, group_sizes, kernels=kernels)


_ROW_TILE = 8


def grouped_mlp(x_nh: jax.Array, weights_nk: jax.Array, idx_nk: jax.Array,
                gate_up_eio: jax.Array | StoredExperts, down_eio: jax.Array | StoredExperts, cfg: ModelConfig,
                first_expert: jax.Array | int = 0, tp_axis: str | None = None, kernels: str = "auto") -> jax.Array:
    """`Σ_k weight[n,k] · expert_{idx[n,k]}(x[n])` over the experts `[first_expert, first_expert + E')`
    whose weights are given (E' = gate_up_eio.shape[0]; float `[E', in, out]` or `StoredExperts`); pairs
    routed elsewhere contribute nothing.
    Pairs are sorted by expert (the others last) and run through two grouped matmuls, dropless.

    Inside a shard_map whose `tp_axis` splits the FFN width, the weights are this device's slice of
    gate_up's `[gate | up]` columns and of down's rows, and the result is a partial sum over `tp_axis`.
    The gate and up columns a device needs sit on different devices of that split, so the gate_up
    outputs are all-gathered over `tp_axis` before the SwiGLU. `kernels` picks the quantized experts' matmul
    (`dsjax.kernels.dispatch`)."""
    n, k = idx_nk.shape
    e_local = gate_up_eio.shape[0]
    local_e = idx_nk.reshape(-1) - first_expert
    mine = (local_e >= 0) & (local_e < e_local)
    local_e = jnp.where(mine, local_e, e_local)  # routed elsewhere: sorted after every local group
    order = jnp.argsort(local_e, stable=True)
    group_sizes = jnp.bincount(local_e, length=e_local).astype(jnp.int32)
    x_ph = jnp.take(x_nh, order // k, axis=0)
    # tokamax's Mosaic GPU kernel tiles the rows by 8: pad them (the padding belongs to no group).
    x_ph = jnp.pad(x_ph, ((0, -x_ph.shape[0] % _ROW_TILE), (0, 0)))
    gate_up_p = _grouped_matmul(x_ph, gate_up_eio, group_sizes, kernels)
    inter = cfg.moe_intermediate_size
    width = down_eio.shape[1]  # this device's share of the FFN width (all of it without tp)
    start = 0
    if tp_axis is not None:
        gate_up_p = jax.lax.all_gather(gate_up_p, tp_axis, axis=1, tiled=True)
        start = jax.lax.axis_index(tp_axis) * width
    gate_p = jax.lax.dynamic_slice_in_dim(gate_up_p, start, width, axis=1)
    up_p = jax.lax.dynamic_slice_in_dim(gate_up_p, inter + start, width, axis=1)
    act_p = clamped_swiglu(gate_p, up_p, cfg.swiglu_limit)
    y_ph = _grouped_matmul(act_p, down_eio, group_sizes, kernels)
    # Back to (token, choice) order by a row gather through the inverse permutation: the row scatter
    # through `order` it replaces moved about 0.26 TB/s on an H200 (7.7 ms for 196,608 rows of 5,120).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y_ph = jnp.take(y_ph, inverse, axis=0) * weights_nk.reshape(-1)[:, None].astype(y_ph.dtype)
    y_ph = jnp.where(mine[:, None], y_ph, 0)  # rows past the groups are not defined
    return jnp.sum(y_ph.reshape(n, k, -1), axis=1)


class SharedExpert(nnx.Module):
    """The one always-on MLP of width `moe_intermediate_size` (whatever `n_shared_experts` says)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        h, i, bias, q = cfg.hidden_size, cfg.moe_intermediate_size, cfg.mlp_bias, cfg.quantization
        self.limit = cfg.swiglu_limit
        self.gate_proj = Linear(h, i, rngs=rngs, dtype=dtype, bias=bias, quant=q, axes=("ffn", "embed"))
        self.up_proj = Linear(h, i, rngs=rngs, dtype=dtype, bias=bias, quant=q, axes=("ffn", "embed"))
        self.down_proj = Linear(i, h, rngs=rngs, dtype=dtype, bias=bias, quant=q, axes=("embed", "ffn"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
