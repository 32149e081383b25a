"""Sparse decode attention as a Pallas kernel for GPUs (Triton lowering; interpreted on CPU).

Grid (slot, head block, split). A program keeps `block_h` query heads and an online softmax, walks
its split's share of the key blocks (`block_k` rows each: the window ring's valid prefix, then the
compressed entries, contiguous for HCA or gathered through the indexer's picks for CSA), and
dequantizes each block in registers. A key row is read once per head block, so one head block of
all heads reads the cache once; `num_splits` > 1 divides the keys between programs (flash-decoding)
for small batches, and their partial sums are merged outside.

Rows arrive as column pieces whose widths Triton can tile (powers of two): the whole row for float
storage; for fp8 one piece per scale group, for fp4 one per 64 columns (32 bytes, two scale groups),
plus the bf16 rotary slice. Scores sum the pieces' dot products.

Numerics follow `reference.py`: scores, softmax and sums in fp32. For bf16 activations P·V runs on fp16 tensor cores: probabilities
(in [0, 1]) keep 11 significant bits instead of bf16's 8, and every bf16 key value of magnitude in
[2^-14, 65504] is exact in fp16 (smaller ones lose bits below 2^-24; V4's keys are RMS-normalised
rows of order 1). fp32 activations run in IEEE fp32 throughout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsjax.layers.numerics import precision
from dsjax.quant import FP4_GROUP, PackedKV, ue8m0_to_float

_FP4_PIECE = 64  # columns per fp4 piece: 32 bytes, two scale groups


@dataclasses.dataclass(frozen=True)
class Piece:
    """Columns `[col, col + width)` of a row, stored as `kind`: "float", "fp8", "fp4" or "rope"."""

    kind: str
    col: int
    width: int


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def row_pieces(rows, width: int, what: str) -> tuple[Piece, ...]:
    """How a kernel tiles one row of `rows` (array or PackedKV); refuses layouts Triton cannot tile."""
    if not isinstance(rows, PackedKV):
        if not _power_of_two(width) or width < 16:
            raise ValueError(f"sparse decode kernel: {what} rows of {width} channels; the GPU kernel needs "
                             "a power of two ≥ 16")
        return (Piece("float", 0, width),)
    rd = rows.rope.shape[-1]
    body = width - rd
    step = rows.group if rows.fmt == "fp8" else _FP4_PIECE
    if not _power_of_two(step) or step < 16 or body % step or (rd and (not _power_of_two(rd) or rd < 16)):
        raise ValueError(f"sparse decode kernel: {what} rows hold {body} {rows.fmt} channels in groups of "
                         f"{rows.group} and {rd} rotary channels; the GPU kernel needs the {rows.fmt} channels "
                         f"in whole pieces of {step} (a power of two ≥ 16) and a power-of-two rotary slice ≥ 16")
    pieces = tuple(Piece(rows.fmt, c, step) for c in range(0, body, step))
    return pieces + ((Piece("rope", body, rd),) if rd else ())


def _e2m1(code):
    """e2m1 codes (int32, 0-15) → fp32 values: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    e, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).astype(jnp.float32) * 0.25)
    return jnp.where(code >= 8, -magnitude, magnitude)


def _load_piece(refs, piece: Piece, rows_k, dtype):
    """Piece `piece` of key rows `rows_k` as `[block_k, width]` values in `dtype`, dequantized as
    `quant.unpack_kv` does (fp32 product, one rounding)."""
    if piece.kind == "float":
        return refs[0][rows_k, :].astype(dtype)
    codes_ref, scales_ref, rope_ref = refs
    if piece.kind == "rope":
        return rope_ref[rows_k, :].astype(dtype)
    if piece.kind == "fp8":
        codes = codes_ref[rows_k, pl.ds(piece.col, piece.width)].astype(jnp.float32)
        scale = scales_ref[rows_k, pl.ds(piece.col // piece.width, 1)].astype(jnp.float32)
        return (codes * scale).astype(dtype)
    half = piece.width // 2
    byte = codes_ref[rows_k, pl.ds(piece.col // 2, half)].astype(jnp.int32) & 0xFF
    # Low nibble = even column: interleave the two halves back into column order.
    values = jnp.stack([_e2m1(byte & 0xF), _e2m1(byte >> 4)], axis=-1).reshape(byte.shape[0], piece.width)
    g = piece.col // FP4_GROUP
    s0 = ue8m0_to_float(scales_ref[rows_k, pl.ds(g, 1)])
    s1 = ue8m0_to_float(scales_ref[rows_k, pl.ds(g + 1, 1)])
    column = jax.lax.broadcasted_iota(jnp.int32, (1, piece.width), 1)
    return (values * jnp.where(column < FP4_GROUP, s0, s1)).astype(dtype)


def _kernel(*refs, scale, block_k, n_window_refs, n_entry_refs, window_pieces, entry_pieces, mode, num_splits,
            n_entry_rows, n_picks):
    q_ref, sinks_ref, window_len_ref, entries_len_ref = refs[:4]
    refs = refs[4:]
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
        tiles = [_load_piece(refs_, p, rows_k, dtype) for p in pieces]
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

    window_len = window_len_ref[...]
    n_window_blocks = pl.cdiv(window_len, block_k)
    if mode == "picks":
        n_entry_blocks = n_picks // block_k
    elif mode == "prefix":
        entries_len = entries_len_ref[...]
        n_entry_blocks = pl.cdiv(entries_len, block_k)
    else:
        n_entry_blocks = 0
    total = n_window_blocks + n_entry_blocks
    lo, hi = split * total // num_splits, (split + 1) * total // num_splits

    def window_block(j, carry):
        rows, valid = block_rows(j, window_len)
        return attend(carry, window_pieces, window_refs, jnp.minimum(rows, window_len - 1), valid)

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


def _storage(rows) -> list[jax.Array]:
    return [rows.codes, rows.scales, rows.rope] if isinstance(rows, PackedKV) else [rows]


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", "block_h", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def sparse_decode_gpu(q_bhd: jax.Array, window, window_len_b: jax.Array, entries, sinks_h: jax.Array, scale: float,
                      *, entries_len_b: jax.Array | None = None, idx_bk: jax.Array | None = None, out_dtype=None,
                      block_h: int | None = None, block_k: int = 32, num_splits: int = 1, num_warps: int = 8,
                      num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """`reference.sparse_decode_reference` as a Pallas kernel (same arguments and result)."""
    b, h, d = q_bhd.shape
    block_h = block_h or min(h, 64)
    mode = "none" if entries is None else ("picks" if idx_bk is not None else "prefix")
    if entries is not None and (entries_len_b is None) == (idx_bk is None):
        raise ValueError("sparse decode: give exactly one of entries_len_b (attend a prefix) and idx_bk (picks)")
    for what, n, size in (("heads", h, block_h),):
        if n % size or size < 16:
            raise ValueError(f"sparse_decode_gpu: {what} ({n}) must be a multiple of block_h ({size} ≥ 16)")
    window_pieces = row_pieces(window, d, "window")
    entry_pieces = () if entries is None else row_pieces(entries, d, "entry")
    if entries is not None and entry_pieces != window_pieces:
        # Accumulators are per piece of the window's layout; entries must tile the same columns.
        raise ValueError("sparse decode kernel: window and entries must split their rows at the same columns, "
                         f"got {window_pieces} and {entry_pieces}")

    per_slot = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda i, j, s: (i,) + (0,) * (a.ndim - 1))  # noqa: E731
    window_arrays = _storage(window)
    entry_arrays = [] if entries is None else _storage(entries)
    scalars = [window_len_b.astype(jnp.int32),
               (entries_len_b if entries_len_b is not None else jnp.zeros((b,), jnp.int32)).astype(jnp.int32)]
    inputs = [q_bhd, sinks_h.astype(jnp.float32), *scalars, *window_arrays, *entry_arrays]
    in_specs = [pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0)),
                pl.BlockSpec((block_h,), lambda i, j, s: (j,)),
                pl.BlockSpec((None,), lambda i, j, s: (i,)), pl.BlockSpec((None,), lambda i, j, s: (i,))]
    in_specs += [per_slot(a) for a in window_arrays + entry_arrays]
    n_picks = 0
    if mode == "picks":
        n_picks = -(-idx_bk.shape[1] // block_k) * block_k
        idx = jnp.pad(idx_bk.astype(jnp.int32), ((0, 0), (0, n_picks - idx_bk.shape[1])), constant_values=-1)
        inputs.append(idx)
        in_specs.append(per_slot(idx))

    out_dtype = out_dtype or q_bhd.dtype
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, h, d), out_dtype)
        out_specs = pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((b, num_splits, h, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, num_splits, 2, h), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, block_h, d), lambda i, j, s: (i, s, j, 0)),
                     pl.BlockSpec((None, None, 2, block_h), lambda i, j, s: (i, s, 0, j)))
    n_entry_rows = 0 if entries is None else jax.tree.leaves(entries)[0].shape[1]
    kernel = functools.partial(
        _kernel, scale=scale, block_k=block_k, n_window_refs=len(window_arrays), n_entry_refs=len(entry_arrays),
        window_pieces=window_pieces, entry_pieces=entry_pieces, mode=mode, num_splits=num_splits,
        n_entry_rows=n_entry_rows, n_picks=n_picks)
    out = pl.pallas_call(
        kernel, grid=(b, h // block_h, num_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dsjax_sparse_decode",
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
