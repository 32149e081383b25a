"""Sparse decode attention as a Pallas kernel for GPUs (Triton lowering; interpreted on CPU).

Grid (slot, head block, split). A program keeps `block_h` query heads and an online softmax, walks
its split's share of the key blocks (`block_k` rows each: the window ring's valid prefix, then the
compressed entries, contiguous for HCA or gathered through the indexer's picks for CSA up to the row's
last valid pick), and dequantizes each block in registers. A key row is read once per head block, so
one head block of all heads reads the cache once; `num_splits` > 1 divides the keys between programs
(flash-decoding) for small batches, and their partial sums are merged outside.

Rows arrive as column pieces (`kernels/triton_rows.py`) whose widths Triton can tile; scores sum the
pieces' dot products and each piece has its own output accumulator.

Numerics follow `reference.py`: scores, softmax and sums in fp32. For bf16 activations P·V runs on
fp16 tensor cores: probabilities (in [0, 1]) keep 11 significant bits instead of bf16's 8, and every
bf16 key value of magnitude in [2^-14, 65504] is exact in fp16 (smaller ones lose bits below 2^-24;
larger ones overflow: V4's keys are RMS-normalised rows of order 1). fp32 activations run in IEEE
fp32 throughout. Measured against the reference: relative error about 1e-4 in bf16 (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.triton_rows import load_piece, row_pieces, storage
from dsjax.numerics import precision

def _kernel(*refs, scale, block_k, n_window_refs, n_entry_refs, window_pieces, entry_pieces, mode, num_splits,
            n_window_rows, n_entry_rows):
    q_ref, sinks_ref, window_start_ref, window_end_ref, entries_len_ref = refs[:5]
    refs = refs[5:]
    window_refs, refs = refs[:n_window_refs], refs[n_window_refs:]
    entry_refs, refs = refs[:n_entry_refs], refs[n_entry_refs:]
    if mode == "picks":
        idx_ref, refs = refs[0], refs[1:]
    o_ref = refs[0]
    dtype = q_ref.dtype
    pv_dtype = jnp.float16 if dtype == jnp.bfloat16 else dtype
    # Triton's default for fp32 operands is TF32 (10-bit mantissas): ask for IEEE fp32.
    exact = precision(q_ref)
    split = pl.program_id(2)

    q_pieces = {p.col: q_ref[:, pl.ds(p.col, p.width)] for p in window_pieces + entry_pieces}

    def attend(carry, pieces, refs_, rows_k, valid_k):
        acc, m_h, l_h = carry
        tiles = [load_piece(refs_, p, rows_k, dtype) for p in pieces]
        s_hk = sum(jnp.dot(q_pieces[p.col], t.T, preferred_element_type=jnp.float32, precision=exact)
                   for p, t in zip(pieces, tiles))
        s_hk = jnp.where(valid_k[None, :], s_hk * scale, -jnp.inf)
        m_new = jnp.maximum(m_h, jnp.max(s_hk, axis=1))
        alpha_h = jnp.exp(m_h - m_new)
        p_hk = jnp.exp(s_hk - m_new[:, None])
        p_pv = p_hk.astype(pv_dtype)
        acc = {c: a * alpha_h[:, None] for c, a in acc.items()}
        for p, t in zip(pieces, tiles):
            acc[p.col] = acc[p.col] + jnp.dot(p_pv, t.astype(pv_dtype), preferred_element_type=jnp.float32,
                                              precision=exact)
        return acc, m_new, l_h * alpha_h + jnp.sum(p_hk, axis=1)

    def block_rows(j, limit):
        rows = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return rows, rows < limit

    window_start, window_end = window_start_ref[...], window_end_ref[...]
    first_window_block = window_start // block_k
    n_window_blocks = jnp.maximum(pl.cdiv(window_end, block_k) - first_window_block, 0)
    # entries_len: a prefix's entry count, or the row's pick slots up to its last valid one (`_attention`)
    entries_len = entries_len_ref[...]
    n_entry_blocks = 0 if mode == "none" else pl.cdiv(entries_len, block_k)
    total = n_window_blocks + n_entry_blocks
    lo, hi = split * total // num_splits, (split + 1) * total // num_splits

    def window_block(j, carry):
        rows, valid = block_rows(first_window_block + j, window_end)
        valid &= rows >= window_start
        return attend(carry, window_pieces, window_refs, jnp.clip(rows, 0, n_window_rows - 1), valid)

    def entry_block(j, carry):
        if mode == "picks":
            idx = idx_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]
            return attend(carry, entry_pieces, entry_refs, jnp.clip(idx, 0, n_entry_rows - 1), idx >= 0)
        rows, valid = block_rows(j, entries_len)
        return attend(carry, entry_pieces, entry_refs, jnp.minimum(rows, n_entry_rows - 1), valid)

    # Every split's running max starts at the sink logit (finite, so fully masked blocks give p = 0,
    # never NaN); split 0 alone counts the sink's mass.
    m0 = sinks_ref[...].astype(jnp.float32)
    l0 = jnp.ones_like(m0) * (split == 0).astype(jnp.float32)
    acc0 = {p.col: jnp.zeros((m0.shape[0], p.width), jnp.float32) for p in window_pieces}
    carry = (acc0, m0, l0)
    carry = jax.lax.fori_loop(lo, jnp.minimum(hi, n_window_blocks), window_block, carry)
    if mode != "none":
        carry = jax.lax.fori_loop(jnp.maximum(lo, n_window_blocks) - n_window_blocks, hi - n_window_blocks,
                                  entry_block, carry)
    acc, m_h, l_h = carry
    if num_splits == 1:
        for p in window_pieces:
            o_ref[:, pl.ds(p.col, p.width)] = (acc[p.col] / l_h[:, None]).astype(o_ref.dtype)
    else:
        ml_ref = refs[1]
        for p in window_pieces:
            o_ref[:, pl.ds(p.col, p.width)] = acc[p.col]
        ml_ref[0, :] = m_h
        ml_ref[1, :] = l_h


_TILING = ("block_h", "block_k", "num_splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", *_TILING))
def sparse_decode_gpu(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array, scale: float,
                      *, entries_len_b: jax.Array | None = None, idx_bk: jax.Array | None = None, out_dtype=None,
                      **tiling) -> jax.Array:
    """`reference.sparse_decode_reference` as a Pallas kernel (same arguments and result); `tiling`:
    `block_h` (heads per program, default min(H, 64)), `block_k` (keys per block, 32), `num_splits`
    (programs per slot and head block, 1), `num_warps` (8), `num_stages` (2), `interpret`."""
    b = q_bhd.shape[0]
    return _attention(q_bhd, window, jnp.zeros((b,), jnp.int32), window_len_b, entries, sinks_h, scale,
                      entries_len_b, idx_bk, 1, out_dtype, **tiling)


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", *_TILING))
def sparse_prefill_gpu(q_bchd: jax.Array, window, window_start_bc: jax.Array, window_end_bc: jax.Array, entries,
                       sinks_h: jax.Array, scale: float, *, entries_len_bc: jax.Array | None = None,
                       idx_bck: jax.Array | None = None, out_dtype=None, **tiling) -> jax.Array:
    """`reference.sparse_prefill_reference` as a Pallas kernel: the decode kernel's grid over every
    (slot, query) row, each reading its slot's rows (`tiling` as `sparse_decode_gpu`'s)."""
    b, c, h, d = q_bchd.shape
    flat = lambda x: None if x is None else x.reshape(b * c, *x.shape[2:])  # noqa: E731
    out = _attention(flat(q_bchd), window, flat(window_start_bc), flat(window_end_bc), entries, sinks_h, scale,
                     flat(entries_len_bc), flat(idx_bck), c, out_dtype, **tiling)
    return out.reshape(b, c, h, d)


def _attention(q_nhd, window, window_start_n, window_end_n, entries, sinks_h, scale, entries_len_n, idx_nk,
               rows_per_slot: int, out_dtype, *, block_h: int | None = None, block_k: int = 32, num_splits: int = 1,
               num_warps: int = 8, num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """N query rows, row i reading slot i // rows_per_slot's window rows [start, end) and entries."""
    n, h, d = q_nhd.shape
    block_h = block_h or min(h, 64)
    mode = "none" if entries is None else ("picks" if idx_nk is not None else "prefix")
    if entries is not None and (entries_len_n is None) == (idx_nk is None):
        raise ValueError("sparse attention: give exactly one of the entry counts (attend a prefix) and the picks")
    if h % block_h or block_h < 16:
        raise CannotTile(f"sparse attention GPU kernel: heads ({h}) must be a multiple of block_h ({block_h} ≥ 16)")
    window_pieces = row_pieces(window, d, "window")
    entry_pieces = () if entries is None else row_pieces(entries, d, "entry")
    if entries is not None and entry_pieces != window_pieces:
        # Accumulators are per piece of the window's layout; entries must tile the same columns.
        raise CannotTile("sparse attention GPU kernel: window and entries must split their rows at the same "
                         f"columns, got {window_pieces} and {entry_pieces}")

    def per_row(a):
        return pl.BlockSpec((None, *a.shape[1:]), lambda i, j, s: (i,) + (0,) * (a.ndim - 1))

    def per_slot(a):
        return pl.BlockSpec((None, *a.shape[1:]), lambda i, j, s: (i // rows_per_slot,) + (0,) * (a.ndim - 1))

    window_arrays = storage(window)
    entry_arrays = [] if entries is None else storage(entries)
    if mode == "picks":
        # The pick slots up to the last valid one (top-k puts the −1s last): blocks past it hold no key, so
        # a short row (early in a prompt, or a short prompt) skips them instead of masking them.
        slot_k = jnp.arange(1, idx_nk.shape[1] + 1, dtype=jnp.int32)
        entries_len_n = jnp.max(jnp.where(idx_nk >= 0, slot_k, 0), axis=1)
    scalars = [x.astype(jnp.int32) for x in (window_start_n, window_end_n, jnp.zeros((n,), jnp.int32)
                                             if entries_len_n is None else entries_len_n)]
    inputs = [q_nhd, sinks_h.astype(jnp.float32), *scalars, *window_arrays, *entry_arrays]
    in_specs = [pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0)),
                pl.BlockSpec((block_h,), lambda i, j, s: (j,))] + [per_row(x) for x in scalars]
    in_specs += [per_slot(a) for a in window_arrays + entry_arrays]
    if mode == "picks":
        n_picks = -(-idx_nk.shape[1] // block_k) * block_k
        idx = jnp.pad(idx_nk.astype(jnp.int32), ((0, 0), (0, n_picks - idx_nk.shape[1])), constant_values=-1)
        inputs.append(idx)
        in_specs.append(per_row(idx))

    out_dtype = out_dtype or q_nhd.dtype
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((n, h, d), out_dtype)
        out_specs = pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((n, num_splits, h, d), jnp.float32),
                     jax.ShapeDtypeStruct((n, num_splits, 2, h), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, block_h, d), lambda i, j, s: (i, s, j, 0)),
                     pl.BlockSpec((None, None, 2, block_h), lambda i, j, s: (i, s, 0, j)))
    kernel = functools.partial(
        _kernel, scale=scale, block_k=block_k, n_window_refs=len(window_arrays), n_entry_refs=len(entry_arrays),
        window_pieces=window_pieces, entry_pieces=entry_pieces, mode=mode, num_splits=num_splits,
        n_window_rows=window_arrays[0].shape[1], n_entry_rows=entry_arrays[0].shape[1] if entry_arrays else 0)
    out = pl.pallas_call(
        kernel, grid=(n, h // block_h, num_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_sparse_decode" if rows_per_slot == 1 else "dsjax_sparse_prefill",
    )(*inputs)
    if num_splits == 1:
        return out
    return merge_splits(*out, out_dtype)


def merge_splits(acc_bshd: jax.Array, ml_bs2h: jax.Array, out_dtype) -> jax.Array:
    """Combine per-split partial softmax sums: each split's running max m, mass l (the sink's in
    split 0) and unnormalised output."""
    m_bsh, l_bsh = ml_bs2h[:, :, 0], ml_bs2h[:, :, 1]
    m_bh = jnp.max(m_bsh, axis=1)
    w_bsh = jnp.exp(m_bsh - m_bh[:, None])
    o_bhd = jnp.einsum("bsh,bshd->bhd", w_bsh, acc_bshd, precision=jax.lax.Precision.HIGHEST)
    return (o_bhd / jnp.einsum("bsh,bsh->bh", w_bsh, l_bsh)[..., None]).astype(out_dtype)
