"""mHC's Sinkhorn normalisation: the Pallas GPU kernel (interpreted on CPU, native on a GPU) against the
pure-JAX reference on fresh random inputs, and the op's choice between them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.sinkhorn.op import sinkhorn
from dsjax.kernels.sinkhorn.reference import rounds, sinkhorn_reference
from dsjax.kernels.sinkhorn.triton import sinkhorn_gpu
from tests.helpers import assert_close

ON_GPU = jax.default_backend() == "gpu"


def comb(seed, shape):
    """Softmax rows plus eps, as `HyperConnection` feeds them: positive, of very different sizes."""
    rng = np.random.default_rng(seed)
    return jax.nn.softmax(jnp.asarray(rng.normal(scale=3.0, size=shape), jnp.float32), axis=-1) + 1e-6


@pytest.mark.parametrize("seed,shape,iters,block", [
    (0, (8, 1, 4, 4), 20, 32),      # a decode step's matrices: 8 slots, one token
    (1, (3, 5, 4, 4), 20, 4),       # 15 matrices: the last block padded
    (2, (2, 64, 4, 4), 7, 32),      # a prefill chunk, several programs
    (3, (5, 2, 2), 1, 2),           # one column normalisation only
    (4, (4, 8, 8), 0, 32),          # no rounds asked for: still column-normalised once, as the reference
])
def test_kernel_matches_reference(seed, shape, iters, block):
    c = comb(seed, shape)
    want = np.asarray(sinkhorn_reference(c, iters, 1e-6))
    got = np.asarray(sinkhorn_gpu(c, iters, 1e-6, block=block, interpret=not ON_GPU))
    assert got.shape == want.shape and got.dtype == np.float32
    if ON_GPU:  # XLA and Triton divide and sum in their own ways on a GPU
        assert_close(got, want, rtol=1e-5)
    else:
        np.testing.assert_array_equal(got, want)  # the same operations in the same order


def test_the_result_ends_column_normalised_and_near_doubly_stochastic():
    out = np.asarray(sinkhorn_gpu(comb(5, (3, 4, 4)) + 0.1, 20, 1e-6, interpret=not ON_GPU))
    np.testing.assert_allclose(out.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-3)


def test_rolled_and_unrolled_rounds_agree():
    c = comb(6, (6, 4, 4))
    np.testing.assert_allclose(np.asarray(rounds(c, 20, 1e-6, unroll=True)), np.asarray(rounds(c, 20, 1e-6)),
                               rtol=1e-6)


@pytest.mark.parametrize("shape,dtype,why", [((2, 3, 3), jnp.float32, "n a power of two"),
                                             ((2, 4, 2), jnp.float32, "n a power of two"),
                                             ((2, 4, 4), jnp.bfloat16, "float32")])
def test_untileable_inputs_are_refused_and_the_op_takes_the_reference(shape, dtype, why):
    c = comb(7, shape).astype(dtype)
    with pytest.raises(CannotTile, match=why):
        sinkhorn_gpu(c, 5, 1e-6, interpret=True)
    np.testing.assert_array_equal(np.asarray(sinkhorn(c, 5, 1e-6, kernels="interpret")),
                                  np.asarray(sinkhorn_reference(c, 5, 1e-6)))


def test_the_op_runs_the_kernel_when_asked_to_interpret():
    c = comb(8, (4, 1, 4, 4))
    program = lambda kernels: str(jax.make_jaxpr(lambda x: sinkhorn(x, 20, 1e-6, kernels=kernels))(c))  # noqa: E731
    assert "pallas_call" in program("interpret") and "pallas_call" not in program("reference")
    got, want = (np.asarray(sinkhorn(c, 20, 1e-6, kernels=k)) for k in ("interpret", "reference"))
    if ON_GPU:  # the reference's rounds are unrolled on a GPU, the interpreted kernel's a loop: XLA fuses
        assert_close(got, want, rtol=1e-5)  # (and so rounds) the two differently
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernels", ["interpret", "auto"])
def test_the_op_differentiates_as_the_reference(kernels):
    """Training takes gradients through mHC: the op's derivative is the reference's, whatever runs forward."""
    c = comb(9, (3, 1, 4, 4))
    weights = jnp.asarray(np.random.default_rng(10).normal(size=c.shape), jnp.float32)
    loss = lambda f: (lambda x: jnp.sum(f(x) * weights))  # noqa: E731
    got = jax.grad(loss(lambda x: sinkhorn(x, 20, 1e-6, kernels=kernels)))(c)
    want = jax.grad(loss(lambda x: sinkhorn_reference(x, 20, 1e-6)))(c)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
