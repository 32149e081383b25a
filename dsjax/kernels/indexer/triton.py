"""The lightning indexer's scores as a Pallas kernel for GPUs (Triton lowering; interpreted on CPU):
decode (one query per slot) and prefill (a chunk of C queries per slot) in one kernel.

Grid (slot, query block, key span): a program takes `block_q` of its slot's queries, each `[nI, c]`
with its head weights, and walks `tiles` blocks of `block_t` consecutive keys. Each key block is loaded
once for the whole query block, then for each query: one `[block_t, c] × [c, nI]` product (per scale
group for fp8 keys: the codes, exact in bf16, are multiplied first and the group's row scale applied to
the fp32 sums; V4.1's MXFP4 key records, read as they are stored, likewise per 32-channel scale group:
each byte's two codes moved bit by bit into fp16 `e2m1 · 2^-14`, the even channels and the odd ones
multiplied apart against queries whose columns were put in that order outside the kernel, so no
arithmetic decodes a code and nothing interleaves), ReLU, the weighted sum over heads and a row of
scores. So a chunk reads its slot's keys `C / block_q` times, not C times; key blocks past every
query's count of the block write −inf without reading keys. Only the head-summed `[C, T]` scores reach
memory, never the `[C, nI, T]` products.

fp8 codes against bf16 queries multiply on fp16 tensor cores: the codes convert to fp16 in one
instruction and exactly (to bf16 they take three), which made the decode kernel 1.2× faster on an
H200 (fp4 codes, moved into fp16's bits, take a few logic operations). The queries stay exact too:
each head's row is first multiplied by the power of two that puts its largest magnitude in
[2^14, 2^15) (within fp16's range, so nothing overflows), and the sums are divided by it again. Only
elements below 2^-28 of their row's largest fall into fp16's subnormals, an error of at most 2^-39 of
that largest element: every product is still exact in the fp32 sums.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.gpu_fp16 import fp16_rows
from dsjax.kernels.triton_rows import fp4_query_order, load_fp4_halves, load_piece, row_pieces, storage
from dsjax.numerics import precision
from dsjax.quant import FP4_GROUP, PackedKV


def _query_slices(pieces) -> list[tuple[int, int]]:
    """The (column, width) slices a key block's operands multiply: a piece each, or for fp4 pieces the
    16 even and 16 odd columns of each scale group (queries in `fp4_query_order`)."""
    if pieces[0].kind != "fp4":
        return [(p.col, p.width) for p in pieces]
    half = FP4_GROUP // 2
    return [(c, half) for p in pieces for c in range(p.col, p.col + p.width, half)]


def _key_terms(key_refs, pieces, rows_k, dtype) -> list[tuple[list, jax.Array | None]]:
    """A key block as products to sum: `([(query column, key operand [block_t, width]), …], row scale or
    None)`, each product's sum times its row scale (`[block_t, 1]`)."""
    if pieces[0].kind == "fp4":  # fp16 e2m1 · 2^-14 codes, the 2^14 applied by the caller
        half = FP4_GROUP // 2
        return [([(col, even.astype(dtype)), (col + half, odd.astype(dtype))], scale)
                for p in pieces
                for col, (even, odd, scale) in zip(range(p.col, p.col + p.width, FP4_GROUP),
                                                   load_fp4_halves(key_refs, p, rows_k))]
    terms = []
    for p in pieces:
        tile = load_piece(key_refs, p, rows_k, dtype, scaled=False)
        codes, row_scale = tile if isinstance(tile, tuple) else (tile, None)
        terms.append(([(p.col, codes)], row_scale))
    return terms


def _kernel(q_ref, w_ref, len_ref, *refs, scale, block_q, block_t, tiles, pieces, n_rows, fuse):
    *key_refs, o_ref = refs
    fp4 = pieces[0].kind == "fp4"
    fp16 = q_ref.dtype == jnp.bfloat16 and pieces[0].kind in ("fp8", "fp4")
    dtype = jnp.float16 if fp16 else q_ref.dtype
    exact = precision(q_ref)
    heads = q_ref.shape[1]
    slices = _query_slices(pieces)

    def queries(i):
        """Queries `i` (a slice of the block) as `[queries·heads, width]` slices (fp16-scaled for fp8 and
        fp4 keys), their per-row unscale (fp4: times 2^14, `load_fp4_halves`) and their head weights."""
        n = i.stop - i.start
        q_pieces = {c: q_ref[i, :, pl.ds(c, w)].reshape(n * heads, w) for c, w in slices}
        unscale = None
        if fp16:
            q_pieces, unscale = fp16_rows(q_pieces)
        if fp4:
            unscale = jnp.full((n * heads,), 2.0 ** 14, jnp.float32) if unscale is None else unscale * 2.0 ** 14
        return q_pieces, unscale, w_ref[i, :].astype(jnp.float32)

    # fuse: every query's heads are rows of one product with the key block (`[block_q·heads, block_t]`),
    # its operand kept in registers across the key loop. Else one product per query, keys along rows
    # (decode's tiling: one query of 32-64 heads is too few rows for Hopper's wgmma); a block of queries
    # then reloads each query's (from L1/L2) per key block instead of holding them all.
    hoisted = queries(slice(0, block_q)) if fuse or block_q == 1 else None
    lens = [len_ref[i] for i in range(block_q)]
    span0 = pl.program_id(2) * tiles * block_t
    n_live = jnp.clip(pl.cdiv(functools.reduce(jnp.maximum, lens) - span0, block_t), 0, tiles)

    def live(j, carry):
        rows = span0 + j * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
        rows_k = jnp.minimum(rows, n_rows - 1)
        terms = _key_terms(key_refs, pieces, rows_k, dtype)
        at = pl.ds(pl.multiple_of(j * block_t, block_t), block_t)
        if fuse:
            q_pieces, unscale, w_qh = hoisted
            dots = jnp.zeros((block_q * heads, block_t), jnp.float32)
            for parts, row_scale in terms:
                d = functools.reduce(operator.add, [
                    jnp.dot(q_pieces[c], keys.T, preferred_element_type=jnp.float32, precision=exact)
                    for c, keys in parts])
                dots += d if row_scale is None else d * row_scale.reshape(1, block_t)
            if unscale is not None:
                dots = dots * unscale[:, None]
            dots_qht = jnp.maximum(dots, 0.0).reshape(block_q, heads, block_t)
            score_qt = jnp.sum(dots_qht * w_qh[:, :, None], axis=1) * scale
            o_ref[:, at] = jnp.where(rows[None, :] < len_ref[...][:, None], score_qt, -jnp.inf)
            return carry
        for i in range(block_q):
            q_pieces, unscale_h, w_h = hoisted or queries(slice(i, i + 1))
            # Keys along rows: the head sum reduces within a row of the product's layout.
            dots_th = jnp.zeros((block_t, heads), jnp.float32)
            for parts, row_scale in terms:
                d = functools.reduce(operator.add, [
                    jnp.dot(keys, q_pieces[c].T, preferred_element_type=jnp.float32, precision=exact)
                    for c, keys in parts])
                dots_th += d if row_scale is None else d * row_scale
            if unscale_h is not None:
                dots_th = dots_th * unscale_h[None, :]
            score_t = jnp.sum(jnp.maximum(dots_th, 0.0) * w_h, axis=1) * scale
            o_ref[i, at] = jnp.where(rows < lens[i], score_t, -jnp.inf)
        return carry

    def dead(j, carry):
        o_ref[:, pl.ds(pl.multiple_of(j * block_t, block_t), block_t)] = jnp.full((block_q, block_t), -jnp.inf,
                                                                                   jnp.float32)
        return carry

    jax.lax.fori_loop(0, n_live, live, 0)
    jax.lax.fori_loop(n_live, tiles, dead, 0)


# On an H200 at 128K-1M context (`docs/benchmarks.md`), fusing 4 queries of V4.1's 32 heads (128 rows)
# was 12% faster than a product per query; 4 of V4's 64 heads (256 rows) were 1.6-2.2x slower.
FUSE_ROWS = 128


def fuses(block_q: int, heads: int) -> bool:
    """Whether the chunk kernel fuses by default: a block of several queries whose heads make at most
    `FUSE_ROWS` rows."""
    return block_q > 1 and block_q * heads <= FUSE_ROWS


_TILING = ("block_t", "tiles", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=("scale", *_TILING))
def index_scores_gpu(q_bhc: jax.Array, weights_bh: jax.Array, keys, keys_len_b: jax.Array, scale: float, *,
                     block_t: int = 64, tiles: int = 16, num_warps: int = 4, num_stages: int = 2,
                     interpret: bool = False) -> jax.Array:
    """`reference.index_scores_reference` as a Pallas kernel (same arguments and result): one query per
    slot. The default tiling was the fastest of a sweep on an H200 at batch 64 and 128K context
    (`docs/benchmarks.md`)."""
    return index_scores_chunk_gpu(q_bhc[:, None], weights_bh[:, None], keys, keys_len_b[:, None], scale, block_q=1,
                                  block_t=block_t, tiles=tiles, fuse=False, num_warps=num_warps,
                                  num_stages=num_stages, interpret=interpret)[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "fuse", *_TILING))
def index_scores_chunk_gpu(q_bchc: jax.Array, weights_bch: jax.Array, keys, keys_len_bc: jax.Array, scale: float,
                           *, block_q: int = 4, block_t: int = 128, tiles: int = 8, fuse: bool | None = None,
                           num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """`reference.index_scores_chunk_reference` as a Pallas kernel (same arguments and `[B, C, T]` result);
    `block_q` queries of a slot per program (C is padded to a multiple of it). The default tiling was the
    fastest of a sweep on an H200 at 1M context, 2048 queries (`docs/benchmarks.md`). `fuse` (one product
    for the block's queries and heads) defaults to on where that product has at most `FUSE_ROWS` rows."""
    b, c_len, h, c = q_bchc.shape
    if isinstance(keys, PackedKV) and keys.fmt != "fp8":  # V4 stores its index keys in fp8 or a float dtype
        raise CannotTile(f"index_scores_gpu: V4's index keys are stored as fp8 or float, got {keys.fmt}")
    if h % 16 or block_t % 16:
        raise CannotTile(f"index_scores_gpu: index heads ({h}) and block_t ({block_t}) must be multiples of 16")
    if block_q < 1 or block_q & (block_q - 1):  # the interpreter takes any; Triton's lowering refuses them
        raise CannotTile(f"index_scores_chunk_gpu: block_q must be a power of two (Triton's blocks are), got {block_q}")
    pieces = row_pieces(keys, c, "index key")
    if pieces[0].kind == "fp4":  # the kernel multiplies each scale group's even and odd columns apart
        q_bchc = fp4_query_order(q_bchc)
    arrays = storage(keys)
    t = arrays[0].shape[1]
    span = block_t * tiles
    n_spans = -(-t // span)
    block_q = min(block_q, pl.next_power_of_2(c_len))
    fuse = fuses(block_q, h) if fuse is None else fuse
    pad = -c_len % block_q
    if pad:  # padded queries see no keys
        q_bchc, weights_bch = (jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in (q_bchc, weights_bch))
        keys_len_bc = jnp.pad(keys_len_bc, ((0, 0), (0, pad)))
    n_q = (c_len + pad) // block_q
    per_slot = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda i, q, j: (i,) + (0,) * (a.ndim - 1))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_q=block_q, block_t=block_t, tiles=tiles, pieces=pieces,
                          n_rows=t, fuse=fuse and block_q > 1),
        grid=(b, n_q, n_spans),
        in_specs=[pl.BlockSpec((None, block_q, h, c), lambda i, q, j: (i, q, 0, 0)),
                  pl.BlockSpec((None, block_q, h), lambda i, q, j: (i, q, 0)),
                  pl.BlockSpec((None, block_q), lambda i, q, j: (i, q))] + [per_slot(a) for a in arrays],
        out_specs=pl.BlockSpec((None, block_q, span), lambda i, q, j: (i, q, j)),
        out_shape=jax.ShapeDtypeStruct((b, c_len + pad, n_spans * span), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_index_scores",
    )(q_bchc, weights_bch.astype(jnp.float32), keys_len_bc.astype(jnp.int32), *arrays)
    return out[:, :c_len, :t]
