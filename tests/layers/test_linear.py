"""FP8 linears: the dequantized product by default, and through `dense_fp8_matmul`'s kernel (interpreted)
where `DENSE_MAX_ROWS` lets it run, for one linear and for a grouped projection."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.config import QuantConfig
from dsjax.kernels.expert_matmul import op
from dsjax.layers.linear import GroupedLinear, Linear
from dsjax.numerics import einsum
from tests.kernels.test_expert_matmul_mosaic_gpu import close


def fp8(module, block=(128, 128)):
    return module(rngs=nnx.Rngs(0), dtype=jnp.bfloat16, std=1.0, quant=QuantConfig(weight_block_size=block))


def grouped_product(layer, x):
    w = layer.dense_weight(x.dtype)
    return einsum("...gi,gri->...gr", x, w.reshape(layer.groups, -1, w.shape[-1]))


def test_fp8_linears_compute_the_dequantized_product_by_default():
    """Linears under `DENSE_MIN_CODES` weights (as every test model's): the same numbers as
    dequantize-then-einsum, bit for bit, whatever `kernels` says."""
    assert 256 * 192 < op.DENSE_MIN_CODES
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 256)), jnp.bfloat16)
    layer = fp8(lambda **kw: Linear(256, 192, **kw))
    layer.kernels = "interpret"
    np.testing.assert_array_equal(np.asarray(layer(x), np.float32),
                                  np.asarray(einsum("...i,oi->...o", x, layer.dense_weight(x.dtype)), np.float32))
    grouped = fp8(lambda **kw: GroupedLinear(256, 2 * 128, 2, **kw))
    xg = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 2, 256)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(grouped(xg), np.float32), np.asarray(grouped_product(grouped, xg),
                                                                                  np.float32))


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_linears_through_the_kernel_equal_the_dequantized_product(monkeypatch, block):
    """V4's blocks and V4.1's."""
    monkeypatch.setattr(op, "DENSE_MAX_ROWS", 256)
    monkeypatch.setattr(op, "DENSE_MIN_CODES", 0)
    calls = []
    real = op.dense_fp8_mosaic
    monkeypatch.setattr(op, "dense_fp8_mosaic", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 256)) * 3, jnp.bfloat16)
    layer = fp8(lambda **kw: Linear(256, 192, **kw), block)
    layer.kernels = "interpret"
    got = layer(x)
    assert got.shape == (2, 3, 192) and (1, 6, 256) in calls
    close(got, einsum("...i,oi->...o", x, layer.dense_weight(x.dtype)))
    grouped = fp8(lambda **kw: GroupedLinear(256, 2 * 128, 2, **kw), block)
    grouped.kernels = "interpret"
    xg = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 2, 256)) * 3, jnp.bfloat16)
    got = grouped(xg)
    assert got.shape == (2, 3, 2, 128) and (2, 6, 256) in calls
    close(got, grouped_product(grouped, xg))


@pytest.mark.parametrize("rows,out", [(300, 256), (6, 2 * 96)])
def test_prefill_rows_and_groups_that_split_a_scale_block_keep_the_dequantized_product(monkeypatch, rows, out):
    """Past `DENSE_MAX_ROWS` rows, or with groups of 96 outputs (each 128-row block of scales would span
    two groups), the kernel is not tried."""
    monkeypatch.setattr(op, "DENSE_MAX_ROWS", 256)
    monkeypatch.setattr(op, "DENSE_MIN_CODES", 0)
    monkeypatch.setattr(op, "dense_fp8_mosaic", lambda *a, **kw: pytest.fail("the kernel was tried"))
    grouped = fp8(lambda **kw: GroupedLinear(256, out, 2, **kw))
    grouped.kernels = "interpret"
    xg = jnp.asarray(np.random.default_rng(2).standard_normal((rows, 2, 256)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(grouped(xg), np.float32), np.asarray(grouped_product(grouped, xg),
                                                                                  np.float32))
