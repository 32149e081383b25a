"""Cache rows inside GPU (Triton) kernels: which column pieces a kernel tiles a row into, and how it
loads and dequantizes one piece of a block of rows.

Triton tiles only power-of-two widths, and V4's rows are not: 448 quantized channels and a 64-wide
bf16 rotary slice. So a row is read as pieces: the whole row for float storage; for fp8 one piece
per scale group, for fp4 one per 64 columns (32 bytes, two scale groups); then the rotary slice.
V4.1's MXFP4 records (`cache_formats.Records`, its index keys) hold the same fp4 codes and ue8m0 scales
as one `[data | scales]` byte row: their pieces read both from that one array, the scales from the
column where they start.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.cache_formats import Records
from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.gpu_fp16 import fp16_of_bits
from dsjax.quant import FP4_GROUP, PackedKV, ue8m0_to_float

_FP4_PIECE = 64  # columns per fp4 piece: 32 bytes, two scale groups


@dataclasses.dataclass(frozen=True)
class Piece:
    """Columns `[col, col + width)` of a row, stored as `kind`: "float", "fp8", "fp4" or "rope"; an fp4
    piece's scales start at column `scale_col` of the scale array (records: the same array as the codes)."""

    kind: str
    col: int
    width: int
    scale_col: int = 0


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def row_pieces(rows, width: int, what: str) -> tuple[Piece, ...]:
    """How a kernel tiles one row of `rows` (array, PackedKV or MXFP4 Records); refuses layouts Triton
    cannot tile."""
    if isinstance(rows, Records):
        if rows.fmt != "mxfp4" or rows.dim != width or width % _FP4_PIECE:
            raise CannotTile(f"GPU kernel: {what} rows are {rows.fmt} records of {rows.dim} channels; it reads "
                             f"mxfp4 records of a multiple of {_FP4_PIECE} channels only")
        return tuple(Piece("fp4", c, _FP4_PIECE, scale_col=width // 2) for c in range(0, width, _FP4_PIECE))
    if not isinstance(rows, PackedKV):
        if not _power_of_two(width) or width < 16:
            raise CannotTile(f"GPU kernel: {what} rows of {width} channels; it needs a power of two ≥ 16")
        return (Piece("float", 0, width),)
    rd = rows.rope.shape[-1]
    body = width - rd
    step = rows.group if rows.fmt == "fp8" else _FP4_PIECE
    if not _power_of_two(step) or step < 16 or body % step or (rd and (not _power_of_two(rd) or rd < 16)):
        raise CannotTile(f"GPU kernel: {what} rows hold {body} {rows.fmt} channels in groups of "
                         f"{rows.group} and {rd} rotary channels; it needs the {rows.fmt} channels "
                         f"in whole pieces of {step} (a power of two ≥ 16) and a power-of-two rotary slice ≥ 16")
    pieces = tuple(Piece(rows.fmt, c, step) for c in range(0, body, step))
    return pieces + ((Piece("rope", body, rd),) if rd else ())


def _e2m1(code):
    """e2m1 codes (int32, 0-15) → fp32 values: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    e, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).astype(jnp.float32) * 0.25)
    return jnp.where(code >= 8, -magnitude, magnitude)


def load_piece(refs, piece: Piece, rows_k, dtype, scaled: bool = True):
    """Piece `piece` of rows `rows_k` as `[block_k, width]` values in `dtype`, dequantized as
    `quant.unpack_kv` does (fp32 product, one rounding). With `scaled=False` an fp8 piece comes back
    as `(codes in dtype, its scales [block_k, 1] fp32)`: codes are exact in bf16, so a dot product
    with them, scaled afterwards, rounds nothing."""
    if piece.kind == "float":
        return refs[0][rows_k, :].astype(dtype)
    codes_ref, scales_ref, *rope_ref = refs
    if piece.kind == "rope":
        return rope_ref[0][rows_k, :].astype(dtype)
    if piece.kind == "fp8":
        codes = codes_ref[rows_k, pl.ds(piece.col, piece.width)]
        scale = scales_ref[rows_k, pl.ds(piece.col // piece.width, 1)].astype(jnp.float32)
        if not scaled:
            return codes.astype(dtype), scale
        return (codes.astype(jnp.float32) * scale).astype(dtype)
    half = piece.width // 2
    byte = codes_ref[rows_k, pl.ds(piece.col // 2, half)].astype(jnp.int32) & 0xFF
    # Low nibble = even column: interleave the two halves back into column order.
    values = jnp.stack([_e2m1(byte & 0xF), _e2m1(byte >> 4)], axis=-1).reshape(byte.shape[0], piece.width)
    g = piece.col // FP4_GROUP
    s0 = ue8m0_to_float(scales_ref[rows_k, pl.ds(piece.scale_col + g, 1)])
    s1 = ue8m0_to_float(scales_ref[rows_k, pl.ds(piece.scale_col + g + 1, 1)])
    column = jax.lax.broadcasted_iota(jnp.int32, (1, piece.width), 1)
    return (values * jnp.where(column < FP4_GROUP, s0, s1)).astype(dtype)


def fp4_query_order(x: jax.Array) -> jax.Array:
    """`[..., c]` → the same columns with each 32-column scale group's 16 even columns first, then its 16
    odd ones: the order of `load_fp4_halves`' operands, so that no kernel interleaves nibbles."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], -1, FP4_GROUP // 2, 2), -1, -2).reshape(x.shape)


def load_fp4_halves(refs, piece: Piece, rows_k) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """An fp4 piece of rows `rows_k` for fp16 tensor cores: for each of its scale groups, the group's even
    and its odd columns as fp16 `e2m1 · 2^-14` (`[block_k, 16]` each: a byte's low and high nibble moved
    into fp16's sign, exponent and mantissa bits, exactly, no arithmetic) and the group's scale (`[block_k,
    1]` fp32). Against queries in `fp4_query_order`, a piece's dot products are
    `2^14 · Σ_g (even_g · q_even_g + odd_g · q_odd_g) · scale_g` (the 2^14 best applied once, at the end)."""
    codes_ref, scales_ref, *_ = refs
    out = []
    for g in range(piece.width // FP4_GROUP):
        col = piece.col + g * FP4_GROUP
        byte = codes_ref[rows_k, pl.ds(col // 2, FP4_GROUP // 2)].astype(jnp.int32)
        even = ((byte & 0x7) << 9) | ((byte & 0x8) << 12)
        odd = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
        scale = ue8m0_to_float(scales_ref[rows_k, pl.ds(piece.scale_col + col // FP4_GROUP, 1)])
        out.append((fp16_of_bits(even), fp16_of_bits(odd), scale))
    return out


def storage(rows) -> list[jax.Array]:
    """The arrays a kernel receives for `rows`, in `load_piece`'s order (a zero-width rotary slice is
    left out; records: their one byte array as both codes and scales)."""
    if isinstance(rows, Records):
        return [rows.data, rows.data]
    if not isinstance(rows, PackedKV):
        return [rows]
    return [rows.codes, rows.scales] + ([rows.rope] if rows.rope.shape[-1] else [])
