"""The Mosaic GPU gathered-attention kernel against the pure-JAX reference: in Mosaic GPU's
interpreter on CPU, natively on a GPU; and its lowering for cuda (on any machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.sparse_attention.mosaic import gathered_attention_mosaic
from dsjax.kernels.sparse_attention.reference import sparse_decode_reference

ON_GPU = jax.default_backend() == "gpu"


def inputs(seed, b, t, k, hole=0.3):
    """Random slots of 64 heads over 512-wide RMS-scale rows; distinct picks with -1 holes (the last
    slot picks nothing), sinks of both signs."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, 64, 512)), jnp.bfloat16)
    entries = jnp.asarray(rng.normal(size=(b, t, 512)), jnp.bfloat16)
    idx = np.stack([rng.permutation(t)[:k] for _ in range(b)])
    idx[rng.random((b, k)) < hole] = -1
    idx[-1] = -1
    sinks = jnp.asarray(rng.normal(size=(64,)) * 2, jnp.float32)
    return q, entries, jnp.asarray(idx, jnp.int32), sinks, 512 ** -0.5


def reference(q, entries, idx, sinks, scale):
    b = q.shape[0]
    empty = jnp.zeros((b, 1, 512), jnp.bfloat16)
    return sparse_decode_reference(q, empty, jnp.zeros((b,), jnp.int32), entries, sinks, scale, idx_bk=idx,
                                   out_dtype=jnp.float32)


@pytest.mark.parametrize("b,t,k,tiling", [(2, 300, 100, {"num_splits": 2})] +
                         ([(64, 32768, 640, {"num_splits": 2}), (3, 4096, 1000, {"num_splits": 1})] if ON_GPU else []))
def test_kernel_matches_reference(b, t, k, tiling):
    args = inputs(b + k, b, t, k)
    want = reference(*args)
    got = gathered_attention_mosaic(*args, **tiling, out_dtype=jnp.float32, interpret=not ON_GPU)
    assert got.shape == want.shape and got.dtype == jnp.float32
    # P·V takes bf16 probabilities (wgmma's operands share one type): ~1e-3 of the output's scale.
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 2e-3, err
    # The slot that picked nothing attends its sink alone: zeros, not NaN.
    np.testing.assert_array_equal(np.asarray(got[-1]), 0.0)


def test_lowers_for_cuda():
    args = inputs(0, 2, 300, 100)
    exported = jax.export.export(jax.jit(gathered_attention_mosaic, static_argnames=("scale",)),
                                 platforms=["cuda"])(*args)
    assert "dsjax_gathered_attention" in exported.mlir_module()


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0][:, :32],) + a[1:], "64 heads"),
    (lambda a: (a[0].astype(jnp.float32),) + a[1:], "bf16"),
    (lambda a: (a[0], a[1][..., :256]) + a[2:], "width 512"),
])
def test_rejects_what_it_cannot_run(change, message):
    with pytest.raises(ValueError, match=message):
        gathered_attention_mosaic(*change(inputs(0, 2, 300, 100)), interpret=True)


def test_rejects_too_many_rows_per_split():
    args = inputs(0, 1, 8192, 6400, hole=0.0)
    with pytest.raises(ValueError, match="raise num_splits"):
        gathered_attention_mosaic(*args, num_splits=1)
