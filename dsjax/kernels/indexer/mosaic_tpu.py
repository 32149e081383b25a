"""The lightning indexer's decode scores as a Pallas kernel for TPUs (Mosaic lowering; runs on CPU under
the TPU interpreter, `interpret=pltpu.InterpretParams()`).

Grid `(slot, key block)`, both parallel. A program scores `block_t` keys of one slot for all H heads:
`dots [H, block_t] = q · kᵀ` on the MXU (keys along lanes, so the `[1, block_t]` row of scores is
written lane-dense into a `[B, 1, T]` output), then `Σ_h w[h] · relu(dots[h])` as a sublane reduction,
times `scale`. The slot's key length is a scalar-prefetch (SMEM) argument: the key index map clamps
blocks past it to the slot's last valid block, so Pallas skips their copy, and those programs only
write −inf.

Keys: a float array `[B, T, c]`, or an fp8 PackedKV (e4m3 codes + fp32 scales per group of
channels, plus an optional bf16 rotary slice; a zero-width one is not passed to the kernel). For fp8
the codes are decoded exactly (e4m3 values are exact in bf16, so a bf16 query still takes one bf16
MXU pass) and each scale group computes `(q_g · codes_gᵀ) · scale_g` in fp32; the scales are
transposed to `[B, G, T]` outside the kernel (1/32 of the codes' bytes for V4's 128-channel keys) so
each group's scale is a lane-major row. fp4 keys are refused: the cache never stores index keys in fp4.

Numerics follow `reference.py`: dots with fp32 sums (bf16 × bf16 products are exact on the MXU; any
fp32 operand makes it an fp32 dot at `Precision.HIGHEST`), relu, weights and the head sum in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.sparse_attention.mosaic_tpu import byte_values, e4m3_to_f32
from dsjax.quant import PackedKV

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _kernel(len_ref, *refs, scale: float, block_t: int, packed: bool, rope: bool, group: int):
    refs = list(refs)
    q_ref = refs.pop(0)
    q_rope_ref = refs.pop(0) if rope else None
    w_ref = refs.pop(0)
    if packed:
        codes_ref, scales_ref = refs.pop(0), refs.pop(0)
        rope_ref = refs.pop(0) if rope else None
    else:
        keys_ref = refs.pop(0)
    (o_ref,) = refs

    b, t = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    start = t * block_t

    def dot(q, k):
        """`q [H, ·] · k [block_t, ·]ᵀ` with fp32 sums; bf16 pairs stay bf16 (exact products)."""
        if q.dtype == k.dtype == jnp.bfloat16:
            return jax.lax.dot_general(q, k, _NT, preferred_element_type=F32)
        return jax.lax.dot_general(q.astype(F32), k.astype(F32), _NT, preferred_element_type=F32,
                                   precision=jax.lax.Precision.HIGHEST)

    @pl.when(start < length)
    def _():
        q = q_ref[...]
        if packed:
            # e4m3 values are exact in bf16: the codes take the queries' dtype without rounding.
            codes = e4m3_to_f32(byte_values(codes_ref[...])).astype(q.dtype)
            scales = scales_ref[...]  # [G, block_t] fp32
            dots = sum(dot(q[:, g * group:(g + 1) * group], codes[:, g * group:(g + 1) * group]) * scales[g:g + 1, :]
                       for g in range(scales.shape[0]))
            if rope:
                dots = dots + dot(q_rope_ref[...], rope_ref[...])
        else:
            dots = dot(q, keys_ref[...])
        score = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[...], axis=0, keepdims=True) * scale  # [1, block_t]
        keys = start + jax.lax.broadcasted_iota(jnp.int32, score.shape, 1)
        o_ref[...] = jnp.where(keys < length, score, -jnp.inf)

    @pl.when(start >= length)
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_t", "interpret"))
def index_scores_tpu(q_bhc: jax.Array, weights_bh: jax.Array, keys, keys_len_b: jax.Array, scale: float, *,
                     block_t: int = 512, interpret=False) -> jax.Array:
    """`reference.index_scores_reference` as a Pallas TPU kernel (same arguments and `[B, T]` fp32 result).

    `block_t`: keys per program; T longer than it must be a multiple of it, and it then a multiple
    of 128 (the scores' lane tile). `interpret`: False on a TPU, or `pltpu.InterpretParams()` on CPU.
    """
    b, h, c = q_bhc.shape
    packed = isinstance(keys, PackedKV)
    if packed and keys.fmt != "fp8":
        raise CannotTile("index_scores_tpu: index keys must be a float array or fp8 PackedKV; fp4 index keys are "
                         "not supported (the cache never stores them in fp4)")
    leading = keys.codes if packed else keys
    if leading.ndim != 3 or leading.shape[0] != b:
        raise ValueError(f"index_scores_tpu: keys {tuple(leading.shape)} must be [B={b}, T, ·]")
    t_len = leading.shape[1]
    rd = keys.rope.shape[-1] if packed else 0
    n = c - rd
    group = keys.group if packed else 0
    if packed:
        n_groups = -(-n // group)
        if keys.codes.shape[-1] != n or keys.scales.shape[-1] != n_groups:
            raise ValueError(f"index_scores_tpu: fp8 keys of {c} channels ({rd} rotary) need codes [..., {n}] and "
                             f"scales [..., {n_groups}], got {tuple(keys.codes.shape)} and {tuple(keys.scales.shape)}")
    elif keys.shape[-1] != c:
        raise ValueError(f"index_scores_tpu: keys {tuple(keys.shape)} must have {c} channels, as the queries")
    if t_len <= block_t:
        block_t = t_len
    elif t_len % block_t or block_t % 128:
        raise CannotTile(f"index_scores_tpu: {t_len} keys cannot be tiled in blocks of block_t={block_t}: block_t "
                         "must divide them and be a multiple of 128")

    def key_block(i, t, lens):
        """Blocks past the slot's keys repeat its last valid block, so their copy is skipped."""
        last = jnp.maximum(jax.lax.div(lens[i] + block_t - 1, jnp.int32(block_t)) - 1, 0)
        return jnp.minimum(t, last)

    rows = lambda w: pl.BlockSpec((None, block_t, w), lambda i, t, lens: (i, key_block(i, t, lens), 0))  # noqa: E731
    whole = lambda w: pl.BlockSpec((None, h, w), lambda i, t, lens: (i, 0, 0))  # noqa: E731
    inputs = [q_bhc[..., :n]] + ([q_bhc[..., n:]] if rd else []) + [weights_bh.astype(F32).reshape(b, h, 1)]
    in_specs = [whole(n)] + ([whole(rd)] if rd else []) + [whole(1)]
    if packed:
        scales_bgt = jnp.swapaxes(keys.scales.astype(F32), 1, 2)  # lane-major: one row per scale group
        inputs += [keys.codes, scales_bgt] + ([keys.rope] if rd else [])
        in_specs += [rows(n), pl.BlockSpec((None, n_groups, block_t), lambda i, t, lens: (i, 0, key_block(i, t, lens)))]
        in_specs += [rows(rd)] if rd else []
    else:
        inputs.append(keys)
        in_specs.append(rows(c))

    kernel = functools.partial(_kernel, scale=float(scale), block_t=block_t, packed=packed, rope=rd > 0, group=group)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, t_len // block_t), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, 1, block_t), lambda i, t, lens: (i, 0, t))),
        out_shape=jax.ShapeDtypeStruct((b, 1, t_len), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="dsjax_index_scores_tpu",
    )(keys_len_b.astype(jnp.int32), *inputs)
    return out.reshape(b, t_len)
