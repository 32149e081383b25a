"""The experts' dequantization that the grouped matmul's reference runs, against the weight readers'
(`quant.dequantize_fp4` / `dequantize_fp8`) transposed: the same bits, stored codes transposed first."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax.kernels.expert_matmul.reference import dequantized
from dsjax.quant import dequantize_fp4, dequantize_fp8, quantize_fp4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp4_experts_dequantize_to_the_transpose_of_the_readers(dtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 40, 96)).astype(np.float32) * np.exp(rng.normal(size=(3, 40, 1)))
    packed, scale = quantize_fp4(jnp.asarray(w))
    got = np.asarray(dequantized(packed, scale, "fp4", dtype), np.float32)
    want = np.swapaxes(np.asarray(dequantize_fp4(packed, scale, dtype), np.float32), -1, -2)
    assert got.shape == (3, 96, 40)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="scales"):
        dequantized(packed, scale[..., :2], "fp4", dtype)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_experts_dequantize_to_the_transpose_of_the_readers(block):
    rng = np.random.default_rng(1)
    e, n, k = 2, 160, 96  # a partial block on both axes at 128 × 128
    q = jnp.asarray(rng.normal(size=(e, n, k)).astype(ml_dtypes.float8_e4m3fn))
    scale = jnp.asarray(rng.uniform(0.5, 2, size=(e, -(-n // block[0]), -(-k // block[1]))).astype(np.float32))
    got = np.asarray(dequantized(q, scale, "fp8", jnp.bfloat16, block), np.float32)
    want = np.swapaxes(np.asarray(dequantize_fp8(q, scale, jnp.bfloat16, block), np.float32), -1, -2)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="storage"):
        dequantized(q, scale, "int4", jnp.bfloat16, block)
