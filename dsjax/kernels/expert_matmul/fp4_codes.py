"""FP4 expert codes in int32 words of eight: the checkpoint's layout, the repacked one (the same codes, their
bits moved once at load so that the GPU kernels decode them in fewer operations), and that decode, which
the Mosaic GPU and the Triton kernels share.

Checkpoints hold two e2m1 codes per byte, code 2i in byte i's low nibble (three magnitude bits, the sign on
top): in a little-endian int32 word code i sits at bits 4i…4i+3. Codes p and p+4 lie 16 bits apart, so one
32-bit operation moves both into the two fp16 halves of a word; `fp16_pairs` makes each pair an fp16
`e2m1 · 2^-14` (the magnitude as the exponent's low bits and the mantissa's top bit, the subnormal 0.5 on
fp16's subnormal 2^-15). The repacked layout puts pair p's magnitudes at `REPACKED_MAGNITUDE[p]` (and + 16)
and its signs at `REPACKED_SIGN[p]` (and + 16): pairs 0 and 1 then decode with at most one shift and one
mask, pairs 2 and 3 with two shifts, two masks and a merge; 8 logic operations and 5 shifts a word against
12 and 8 in the checkpoint's order (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CODE_LAYOUTS = ("checkpoint", "repacked")
REPACKED_MAGNITUDE = (9, 6, 3, 0)
REPACKED_SIGN = (15, 12, 13, 14)
SIGNS = int(np.uint32(0x80008000).view(np.int32))  # the sign bits of two fp16s in one int32
MAGNITUDES = 0x0E000E00  # where an e2m1 magnitude sits in each of two fp16s (`e2m1 · 2^-14`)
SIGNED_MAGNITUDES = int(np.uint32(0x8E008E00).view(np.int32))  # both


def check_layout(code_layout: str, where: str, storage: str = "fp4") -> None:
    """ValueError naming `where` unless `code_layout` is one of `CODE_LAYOUTS`, and "checkpoint" for
    experts other than FP4 (FP8 codes are read as stored)."""
    if code_layout not in CODE_LAYOUTS:
        raise ValueError(f"{where}: code_layout must be one of {CODE_LAYOUTS}, got {code_layout!r}")
    if code_layout != "checkpoint" and storage != "fp4":
        raise ValueError(f"{where}: code_layout {code_layout!r} is for FP4 codes, not {storage!r} experts "
                         "(read as stored)")


def _as_words(w: jax.Array, where: str) -> jax.Array:
    if w.shape[-1] % 4 or jnp.dtype(w.dtype).itemsize != 1:
        raise ValueError(f"{where}: FP4 codes are bytes whose last axis is a multiple of 4 (whole int32 "
                         f"words), got {w.dtype} {w.shape}")
    return lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4), jnp.uint32)


def repack_codes(w: jax.Array) -> jax.Array:
    """FP4 codes as checkpoints hold them (`[…, K/2]` bytes) → the same shape and dtype in the repacked
    layout: each int32 word keeps its eight codes, their bits moved. Meant to run once, as weights load."""
    words = _as_words(w, "repack_codes")
    out = jnp.zeros_like(words)
    for p, (magnitude, sign) in enumerate(zip(REPACKED_MAGNITUDE, REPACKED_SIGN)):
        # codes p and p + 4 together: the same move in both halves of the word
        out |= ((words >> (4 * p)) & 0x00070007) << magnitude
        out |= ((words >> (4 * p + 3)) & 0x00010001) << sign
    return lax.bitcast_convert_type(out, w.dtype).reshape(w.shape)


def unrepack_codes(w: jax.Array) -> jax.Array:
    """`repack_codes`' inverse: repacked codes → the checkpoint's layout, bit for bit."""
    words = _as_words(w, "unrepack_codes")
    out = jnp.zeros_like(words)
    for p, (magnitude, sign) in enumerate(zip(REPACKED_MAGNITUDE, REPACKED_SIGN)):
        out |= ((words >> magnitude) & 0x00070007) << (4 * p)
        out |= ((words >> sign) & 0x00010001) << (4 * p + 3)
    return lax.bitcast_convert_type(out, w.dtype).reshape(w.shape)


def in_checkpoint_layout(w: jax.Array, code_layout: str) -> jax.Array:
    """FP4 codes in `code_layout` → the checkpoint's layout (the same array where it already is)."""
    check_layout(code_layout, "in_checkpoint_layout")
    return w if code_layout == "checkpoint" else unrepack_codes(w)


def fp16_pairs(words, code_layout: str = "checkpoint") -> list:
    """Four int32 arrays from int32 code words (in a kernel or not): codes p and p+4 of each word as two
    fp16 `e2m1 · 2^-14`, low half first, by bit moves only."""
    out = []
    for p in range(4):
        if code_layout == "repacked":
            to_magnitude, to_sign = 9 - REPACKED_MAGNITUDE[p], 15 - REPACKED_SIGN[p]
            if to_magnitude == to_sign:  # one shift aligns sign and magnitude: one mask
                moved = words << to_magnitude if to_magnitude else words
                out.append(moved & SIGNED_MAGNITUDES)
            else:
                out.append(((words << to_magnitude) & MAGNITUDES) | ((words << to_sign) & SIGNS))
            continue
        magnitudes = (words << (9 - 4 * p)) if p < 3 else lax.shift_right_logical(words, 3)
        out.append((magnitudes & MAGNITUDES) | ((words << (12 - 4 * p)) & SIGNS))
    return out
