"""The image encoders' patch attention: queries in blocks give the dense attention, a block's scores are
all that is held, images of a batch never see each other's patches, and `valid_first` orders for cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.patch_attention import _attend_dense, attend, valid_first


@pytest.mark.parametrize("b,n,block", [(1, 37, 8), (3, 40, 8), (2, 12, 16)])
def test_attention_in_query_blocks_is_the_dense_attention(b, n, block):
    """Queries in blocks (the last one padded) give the dense attention's rows, invalid keys masked."""
    rng = np.random.default_rng(n)
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, 2, 8)), jnp.float32) for _ in range(3))
    valid = jnp.asarray(rng.random((b, n)) < 0.7).at[:, 0].set(True)
    got = np.asarray(attend(q, k, v, valid, query_block=block))
    np.testing.assert_allclose(got, np.asarray(_attend_dense(q, k, v, valid)), rtol=1e-6, atol=1e-6)
    assert got.shape == (b, n, 2, 8)


def test_images_of_a_batch_attend_only_their_own_patches():
    """Each image's rows equal those of the image attended alone, whatever its batch neighbours hold."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 20, 2, 8)), jnp.float32) for _ in range(3))
    valid = jnp.asarray(rng.random((3, 20)) < 0.8).at[:, 0].set(True)
    together = np.asarray(attend(q, k, v, valid, query_block=8))
    for i in range(3):
        alone = np.asarray(attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], valid[i:i + 1], query_block=8))[0]
        np.testing.assert_allclose(together[i], alone, rtol=1e-6, atol=1e-7)


def test_attention_in_query_blocks_holds_a_blocks_scores_not_all():
    """XLA's temporaries for 4,096 patches at 16 heads: the dense scores alone are 1 GiB; in blocks of
    512 queries the whole step stays under a quarter of that."""
    n, heads = 4096, 16
    spec = jax.ShapeDtypeStruct((1, n, heads, 64), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((1, n), jnp.bool_)

    def temp(block):
        compiled = jax.jit(lambda q, k, v, m: attend(q, k, v, m, block)).lower(spec, spec, spec, valid).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(n) >= heads * n * n * 4
    assert temp(512) < heads * n * n * 4 // 4


def test_valid_first_is_a_stable_order_of_valid_then_padding():
    valid = jnp.asarray([[False, True, True, False, True], [True, False, False, True, True]])
    order = np.asarray(valid_first(valid))
    np.testing.assert_array_equal(order, [[1, 2, 4, 0, 3], [0, 3, 4, 1, 2]])
