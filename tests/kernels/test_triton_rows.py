"""Cache rows inside GPU kernels: the fp4 pieces' bit-moved fp16 halves against the float decode."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsjax.kernels.triton_rows import Piece, fp4_query_order, load_fp4_halves

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def halves(codes: np.ndarray, scales: np.ndarray):
    """`load_fp4_halves` of one 64-column piece of every row, in an interpreted kernel."""
    rows = codes.shape[0]

    def kernel(codes_ref, scales_ref, even_ref, odd_ref, scale_ref):
        for g, (even, odd, scale) in enumerate(load_fp4_halves((codes_ref, scales_ref), Piece("fp4", 0, 64, 0),
                                                               jnp.arange(rows))):
            even_ref[g] = even
            odd_ref[g] = odd
            scale_ref[g] = scale

    out = (jax.ShapeDtypeStruct((2, rows, 16), jnp.float16),) * 2 + (jax.ShapeDtypeStruct((2, rows, 1), jnp.float32),)
    return [np.asarray(x, np.float32) for x in pl.pallas_call(kernel, out_shape=out, interpret=True)(codes, scales)]


def test_every_byte_decodes_to_its_two_codes_times_2_pow_minus_14():
    """All 256 bytes (low nibble the even column, high the odd one, sign on top), and the groups' scales."""
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    scales = np.array([[120, 130]] * 8, np.uint8)
    even, odd, scale = halves(codes, scales)
    for g in range(2):
        byte = codes[:, 16 * g:16 * (g + 1)]
        np.testing.assert_array_equal(even[g], E2M1[byte & 0xF] * 2.0 ** -14)
        np.testing.assert_array_equal(odd[g], E2M1[byte >> 4] * 2.0 ** -14)
        np.testing.assert_array_equal(np.signbit(even[g]), (byte & 0x8) > 0)  # -0 stays -0
        np.testing.assert_array_equal(scale[g], np.full((8, 1), 2.0 ** (int(scales[0, g]) - 127)))


def test_query_order_puts_each_groups_even_columns_first():
    x = np.arange(2 * 64).reshape(2, 64)
    got = np.asarray(fp4_query_order(jnp.asarray(x)))
    want = np.concatenate([x[:, g * 32:(g + 1) * 32][:, order] for g in range(2)
                           for order in [np.r_[0:32:2, 1:32:2]]], axis=1)
    np.testing.assert_array_equal(got, want)


def test_halves_against_queries_in_that_order_give_the_dequantized_dot_product():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(16, 32), dtype=np.uint8)
    scales = rng.integers(115, 135, size=(16, 2), dtype=np.uint8)
    q = rng.normal(size=64).astype(np.float32)
    even, odd, scale = halves(codes, scales)
    q_ordered = np.asarray(fp4_query_order(jnp.asarray(q)))
    got = 2.0 ** 14 * sum((even[g] @ q_ordered[32 * g:32 * g + 16] + odd[g] @ q_ordered[32 * g + 16:32 * (g + 1)])
                          * scale[g][:, 0] for g in range(2))
    values = np.stack([E2M1[codes & 0xF], E2M1[codes >> 4]], axis=-1).reshape(16, 64)
    values = values * np.repeat(2.0 ** (scales.astype(np.float32) - 127), 32, axis=1)
    np.testing.assert_allclose(got, values @ q, rtol=1e-5)
