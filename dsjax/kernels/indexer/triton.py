"""The lightning indexer's decode scores as a Pallas kernel for GPUs (Triton lowering; interpreted on
CPU).

Grid (slot, key span): a program holds the slot's index queries `[nI, c]` and head weights and walks
`tiles` blocks of `block_t` consecutive keys: one `[block_t, c] × [c, nI]` product per block (per
scale group for fp8 keys: the codes, exact in bf16, are multiplied first and the group's row scale
applied to the fp32 sums), ReLU, the weighted sum over heads, and a row of scores. Spans past the
slot's key count write −inf without reading keys.

fp8 codes against bf16 queries multiply on fp16 tensor cores: the codes convert to fp16 in one
instruction and exactly (to bf16 they take three), which made the kernel 1.2× faster on an H200. The
queries stay exact too: each head's row is first multiplied by the power of two that puts its largest
magnitude in [2^14, 2^15) (within fp16's range, so nothing overflows), and the sums are divided by it
again. Only elements below 2^-28 of their row's largest fall into fp16's subnormals, an error of at
most 2^-39 of that largest element: every product is still exact in the fp32 sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.gpu_fp16 import fp16_rows
from dsjax.kernels.triton_rows import load_piece, row_pieces, storage
from dsjax.numerics import precision
from dsjax.quant import PackedKV


def _kernel(q_ref, w_ref, len_ref, *refs, scale, block_t, tiles, pieces, n_rows):
    *key_refs, o_ref = refs
    fp16 = q_ref.dtype == jnp.bfloat16 and pieces[0].kind == "fp8"
    dtype = jnp.float16 if fp16 else q_ref.dtype
    exact = precision(q_ref)
    w_h = w_ref[...].astype(jnp.float32)
    q_pieces = {p.col: q_ref[:, pl.ds(p.col, p.width)] for p in pieces}
    if fp16:
        q_pieces, unscale_h = fp16_rows(q_pieces)
    keys_len = len_ref[...]
    span0 = pl.program_id(1) * tiles * block_t
    n_live = jnp.clip(pl.cdiv(keys_len - span0, block_t), 0, tiles)

    def live(j, carry):
        rows = span0 + j * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
        rows_k = jnp.minimum(rows, n_rows - 1)
        # Keys along rows: the head sum reduces within a row of the product's layout.
        dots_th = jnp.zeros((block_t, w_h.shape[0]), jnp.float32)
        for p in pieces:
            tile = load_piece(key_refs, p, rows_k, dtype, scaled=False)
            if isinstance(tile, tuple):
                codes, row_scale = tile
                dots_th += jnp.dot(codes, q_pieces[p.col].T, preferred_element_type=jnp.float32,
                                   precision=exact) * row_scale
            else:
                dots_th += jnp.dot(tile, q_pieces[p.col].T, preferred_element_type=jnp.float32, precision=exact)
        if fp16:
            dots_th = dots_th * unscale_h[None, :]
        score_t = jnp.sum(jnp.maximum(dots_th, 0.0) * w_h[None, :], axis=1) * scale
        o_ref[pl.ds(pl.multiple_of(j * block_t, block_t), block_t)] = jnp.where(rows < keys_len, score_t, -jnp.inf)
        return carry

    def dead(j, carry):
        o_ref[pl.ds(pl.multiple_of(j * block_t, block_t), block_t)] = jnp.full((block_t,), -jnp.inf, jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_live, live, 0)
    jax.lax.fori_loop(n_live, tiles, dead, 0)


@functools.partial(jax.jit, static_argnames=("scale", "block_t", "tiles", "num_warps", "num_stages", "interpret"))
def index_scores_gpu(q_bhc: jax.Array, weights_bh: jax.Array, keys, keys_len_b: jax.Array, scale: float, *,
                     block_t: int = 64, tiles: int = 16, num_warps: int = 4, num_stages: int = 2,
                     interpret: bool = False) -> jax.Array:
    """`reference.index_scores_reference` as a Pallas kernel (same arguments and result). The default
    tiling was the fastest of a sweep on an H200 at batch 64 and 128K context (`docs/benchmarks.md`)."""
    b, h, c = q_bhc.shape
    if isinstance(keys, PackedKV) and keys.fmt != "fp8":
        raise CannotTile(f"index_scores_gpu: index keys are stored as fp8 or float, got {keys.fmt}")
    if h % 16 or block_t % 16:
        raise CannotTile(f"index_scores_gpu: index heads ({h}) and block_t ({block_t}) must be multiples of 16")
    pieces = row_pieces(keys, c, "index key")
    arrays = storage(keys)
    t = arrays[0].shape[1]
    span = block_t * tiles
    n_spans = -(-t // span)
    per_slot = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda i, j: (i,) + (0,) * (a.ndim - 1))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_t=block_t, tiles=tiles, pieces=pieces, n_rows=t),
        grid=(b, n_spans),
        in_specs=[pl.BlockSpec((None, h, c), lambda i, j: (i, 0, 0)), pl.BlockSpec((None, h), lambda i, j: (i, 0)),
                  pl.BlockSpec((None,), lambda i, j: (i,))] + [per_slot(a) for a in arrays],
        out_specs=pl.BlockSpec((None, span), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((b, n_spans * span), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_index_scores",
    )(q_bhc, weights_bh.astype(jnp.float32), keys_len_b.astype(jnp.int32), *arrays)
    return out[:, :t]
