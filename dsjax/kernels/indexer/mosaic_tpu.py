"""The lightning indexer's scores as a Pallas kernel for TPUs, for decode (one query per slot) and for
prefill chunks (Mosaic lowering; runs on CPU under the TPU interpreter, `interpret=pltpu.InterpretParams()`).

Grid `(slot, query block, key block)`, all parallel. A program scores `block_t` keys of one slot for
`block_q` queries and all H heads: `dots [block_q · H, block_t] = q · kᵀ` on the MXU (keys along lanes,
so the `[block_q, block_t]` scores are written lane-dense into a `[B, C, T]` output), then
`Σ_h w[h] · relu(dots[h])` per query as a sublane reduction, times `scale`; keys at or past a query's
own length are −inf. Each query block's longest key length is a scalar-prefetch (SMEM) argument: the
key index map clamps blocks past it to its last valid block, so Pallas skips their copy, and those
programs only write −inf. Decode is the chunk of one query.

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
# Queries per program of a prefill chunk: with 32 or 64 heads, 256 or 512 MXU rows. Not tuned: no TPU has
# been lent to this project; the GPU kernel's sweep chose 4 × 32 and 4 × 64 rows (`triton.py`).
BLOCK_Q = 8
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _kernel(maxlen_ref, len_ref, *refs, scale: float, block_t: int, packed: bool, rope: bool, group: int):
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

    b, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = t * block_t
    block_q, h = q_ref.shape[:2]

    def dot(q, k):
        """`q [rows, ·] · k [block_t, ·]ᵀ` with fp32 sums; bf16 pairs stay bf16 (exact products)."""
        if q.dtype == k.dtype == jnp.bfloat16:
            return jax.lax.dot_general(q, k, _NT, preferred_element_type=F32)
        return jax.lax.dot_general(q.astype(F32), k.astype(F32), _NT, preferred_element_type=F32,
                                   precision=jax.lax.Precision.HIGHEST)

    def rows(ref):  # a block's queries × heads as the MXU's rows
        return ref[...].reshape(block_q * h, ref.shape[-1])

    @pl.when(start < maxlen_ref[b, j])
    def _():
        q = rows(q_ref)
        if packed:
            # e4m3 values are exact in bf16: the codes take the queries' dtype without rounding.
            codes = e4m3_to_f32(byte_values(codes_ref[...])).astype(q.dtype)
            scales = scales_ref[...]  # [G, block_t] fp32
            dots = sum(dot(q[:, g * group:(g + 1) * group], codes[:, g * group:(g + 1) * group]) * scales[g:g + 1, :]
                       for g in range(scales.shape[0]))
            if rope:
                dots = dots + dot(rows(q_rope_ref), rope_ref[...])
        else:
            dots = dot(q, keys_ref[...])
        weighted = (jnp.maximum(dots, 0.0) * rows(w_ref)).reshape(block_q, h, block_t)
        score = jnp.sum(weighted, axis=1) * scale  # [block_q, block_t]
        keys = start + jax.lax.broadcasted_iota(jnp.int32, score.shape, 1)
        o_ref[...] = jnp.where(keys < len_ref[...], score, -jnp.inf)

    @pl.when(start >= maxlen_ref[b, j])
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_t", "interpret"))
def index_scores_chunk_tpu(q_bchc: jax.Array, weights_bch: jax.Array, keys, keys_len_bc: jax.Array, scale: float,
                           *, block_q: int = BLOCK_Q, block_t: int = 512, interpret=False) -> jax.Array:
    """`reference.index_scores_chunk_reference` as a Pallas TPU kernel (same arguments and `[B, C, T]` fp32
    result): each program scores `block_q` queries (all heads) against `block_t` keys.

    C longer than `block_q` must be a multiple of it, and it then a multiple of 8 (the sublane tile); T
    longer than `block_t` likewise, with `block_t` a multiple of 128 (the lane tile). Blocks of keys
    past every query of a block are skipped. `interpret`: False on a TPU, or `pltpu.InterpretParams()`.
    """
    b, c_len, h, c = q_bchc.shape
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
    if c_len <= block_q:
        block_q = c_len
    elif c_len % block_q or block_q % 8:
        raise CannotTile(f"index_scores_tpu: {c_len} queries cannot be tiled in blocks of block_q={block_q}: "
                         "block_q must divide them and be a multiple of 8")
    keys_len_bc = keys_len_bc.astype(jnp.int32)
    maxlen_bj = keys_len_bc.reshape(b, c_len // block_q, block_q).max(axis=2)  # a query block's longest reach

    def key_block(i, j, t, maxlen):
        """Blocks past every key of the query block repeat its last valid block, so their copy is skipped."""
        last = jnp.maximum(jax.lax.div(maxlen[i, j] + block_t - 1, jnp.int32(block_t)) - 1, 0)
        return jnp.minimum(t, last)

    rows = lambda w: pl.BlockSpec((None, block_t, w),  # noqa: E731
                                  lambda i, j, t, maxlen: (i, key_block(i, j, t, maxlen), 0))
    queries = lambda w: pl.BlockSpec((None, block_q, h, w), lambda i, j, t, maxlen: (i, j, 0, 0))  # noqa: E731
    inputs = [keys_len_bc[..., None], q_bchc[..., :n]] + ([q_bchc[..., n:]] if rd else [])
    inputs.append(weights_bch.astype(F32)[..., None])
    in_specs = [pl.BlockSpec((None, block_q, 1), lambda i, j, t, maxlen: (i, j, 0)), queries(n)]
    in_specs += ([queries(rd)] if rd else []) + [queries(1)]
    if packed:
        scales_bgt = jnp.swapaxes(keys.scales.astype(F32), 1, 2)  # lane-major: one row per scale group
        inputs += [keys.codes, scales_bgt] + ([keys.rope] if rd else [])
        in_specs += [rows(n), pl.BlockSpec((None, n_groups, block_t),
                                           lambda i, j, t, maxlen: (i, 0, key_block(i, j, t, maxlen)))]
        in_specs += [rows(rd)] if rd else []
    else:
        inputs.append(keys)
        in_specs.append(rows(c))

    kernel = functools.partial(_kernel, scale=float(scale), block_t=block_t, packed=packed, rope=rd > 0, group=group)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, c_len // block_q, t_len // block_t), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, block_q, block_t), lambda i, j, t, maxlen: (i, j, t))),
        out_shape=jax.ShapeDtypeStruct((b, c_len, t_len), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret, name="dsjax_index_scores_tpu",
    )(maxlen_bj, *inputs)


def index_scores_tpu(q_bhc: jax.Array, weights_bh: jax.Array, keys, keys_len_b: jax.Array, scale: float, *,
                     block_t: int = 512, interpret=False) -> jax.Array:
    """`reference.index_scores_reference` (one query per slot, `[B, T]`): `index_scores_chunk_tpu` of C = 1."""
    return index_scores_chunk_tpu(q_bhc[:, None], weights_bh[:, None], keys, keys_len_b[:, None], scale,
                                  block_t=block_t, interpret=interpret)[:, 0]
