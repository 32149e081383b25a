"""Exact fp16 operands for fp16 tensor cores: fp8 and fp4 codes convert to fp16 in one or two
instructions (to bf16 they take several on Hopper), so kernels that multiply codes by bf16 values
convert those values to fp16 too, without losing them: each row is first scaled by the power of two that
puts its largest magnitude in [2^14, 2^15), and the products are scaled back in fp32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def pow2(exponent):
    """2^exponent as fp32, exactly, for int32 exponents in [-126, 127]."""
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def fp16_of_bits(bits):
    """The low 16 bits of int32s as fp16 (codes moved into fp16's bit fields)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


def fp16_rows(pieces_hc: dict) -> tuple[dict, jax.Array]:
    """Column pieces of the same rows as fp16, and `2^-s_h`: each row scaled by the power of two `2^s_h`
    that puts its largest magnitude in [2^14, 2^15), so that bf16 values convert to fp16 without
    overflow or rounding (but for those below 2^-28 of their row's largest: fp16 subnormals)."""
    pieces_hc = {c: x.astype(jnp.float32) for c, x in pieces_hc.items()}
    max_h = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1) for x in pieces_hc.values()])
    biased_h = (jax.lax.bitcast_convert_type(max_h, jnp.int32) >> 23) & 0xFF
    shift_h = jnp.clip(127 + 14 - biased_h, -126, 126)
    return {c: (x * pow2(shift_h)[:, None]).astype(jnp.float16) for c, x in pieces_hc.items()}, pow2(-shift_h)
