"""The float grouped matmul: rows sorted by expert against each expert's matrix, whichever way
`kernels` runs it; on CPU the tuned Hopper tiling must step aside (CannotTile), not fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.grouped_dot import MIN_ROWS_PER_EXPERT, grouped_dot, padded_rows


@pytest.mark.parametrize("kernels", ["auto", "interpret", "reference"])
@pytest.mark.parametrize("rows_per_expert", [3, MIN_ROWS_PER_EXPERT + 5])  # tokamax's choice; the tuned tiling
def test_grouped_dot_equals_a_loop_over_experts(kernels, rows_per_expert):
    rng = np.random.default_rng(rows_per_expert)
    e, k, n = 4, 32, 24
    sizes = rng.multinomial(e * rows_per_expert - 5, np.ones(e) / e)  # 5 rows past the groups
    x = rng.normal(size=(e * rows_per_expert, k)).astype(np.float32)
    w = rng.normal(size=(e, k, n)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w, s: grouped_dot(x, w, s, kernels=kernels))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)))
    start = 0
    for i, size in enumerate(sizes):
        np.testing.assert_allclose(got[start:start + size], x[start:start + size] @ w[i], rtol=1e-5, atol=1e-5)
        start += size
    assert got.shape == (e * rows_per_expert, n) and got.dtype == np.float32


@pytest.mark.parametrize("rows", [120, 128])
def test_padded_rows_leave_the_product_and_its_gradients_alone(rows):
    """The GPU kernels run on rows padded to a multiple of 128 (tokamax's backward needs whole TMA tiles): the
    appended rows are in no group, so the product and both gradients equal XLA's ragged_dot on the rows as given."""
    rng = np.random.default_rng(rows)
    e, k, n = 3, 16, 8
    sizes = jnp.asarray(rng.multinomial(rows - 7, np.ones(e) / e), jnp.int32)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, k, n)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32).at[rows - 7:].set(0)  # rows past the groups

    def plain(x, w):
        return jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)

    def padded(x, w):
        return padded_rows(lambda xp: jax.lax.ragged_dot(xp, w, sizes, precision=jax.lax.Precision.HIGHEST), x)

    y0, vjp0 = jax.vjp(plain, x, w)
    y1, vjp1 = jax.vjp(padded, x, w)
    assert y1.shape == (rows, n)
    np.testing.assert_allclose(y1[:rows - 7], y0[:rows - 7], rtol=1e-6, atol=1e-6)
    for g0, g1 in zip(vjp0(cot), vjp1(cot)):
        np.testing.assert_allclose(g1, g0, rtol=1e-6, atol=1e-6)
