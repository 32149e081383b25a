"""The float grouped matmul: rows sorted by expert against each expert's matrix, whichever way
`kernels` runs it; on CPU the tuned Hopper tiling must step aside (CannotTile), not fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.grouped_dot import MIN_ROWS_PER_EXPERT, grouped_dot


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
