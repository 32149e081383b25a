"""Sparse decode attention: the Pallas GPU kernel (interpreted on CPU, native on a GPU) against the
pure-JAX reference on fresh random inputs, for every cache storage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference
from dsjax.kernels.sparse_attention.triton import sparse_decode_gpu, sparse_prefill_gpu
from dsjax.quant import pack_kv
from tests.helpers import assert_close

ON_GPU = jax.default_backend() == "gpu"


def stored(x, kv_dtype, rope_dim):
    return x if kv_dtype == "bfloat16" else pack_kv(x, kv_dtype, rope_dim)


def inputs(seed, kv_dtype="bfloat16", b=3, h=16, d=128, rd=64, w=64, t=200, k=64, picks=True, dtype=jnp.bfloat16):
    """Random slots with ragged window and entry counts (one slot sees no window key, one no entry),
    distinct picks with -1 holes, sinks of both signs. Keys are RMS-scale rows, as the model's are."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, d)) * 2, dtype)
    window = jnp.asarray(rng.normal(size=(b, w, d)), jnp.bfloat16)
    entries = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    window_len = rng.integers(1, w + 1, size=b)
    window_len[0] = 0
    kw = {}
    if picks:
        idx = np.stack([rng.permutation(t)[:k] for _ in range(b)])  # distinct, as a top-k's are
        idx[rng.random((b, k)) < 0.3] = -1
        idx[-1] = -1
        kw["idx_bk"] = jnp.asarray(idx, jnp.int32)
    else:
        n = rng.integers(1, t + 1, size=b)
        n[-1] = 0
        kw["entries_len_b"] = jnp.asarray(n, jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32)
    args = (q, stored(window, kv_dtype, rd), jnp.asarray(window_len, jnp.int32), stored(entries, kv_dtype, rd), sinks,
            d ** -0.5)
    return args, kw


CASES = [("bfloat16", {}, {}), ("fp8", {}, {}), ("fp4", {}, {}),
         ("bfloat16", {"picks": False, "b": 2, "h": 32, "w": 32, "t": 300}, {"block_h": 16}),
         ("fp8", {"picks": False, "w": 128, "k": 96}, {"num_splits": 3, "block_k": 16}),
         ("fp4", {"h": 64, "d": 512, "w": 128, "t": 700, "k": 512}, {"block_h": 32, "num_splits": 2}),
         ("bfloat16", {"dtype": jnp.float32, "b": 2}, {"block_h": 16})]


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_kernel_matches_reference(seed, case):
    kv_dtype, shape, tiling = case
    args, kw = inputs(seed, kv_dtype, **shape)
    # Compared before the output's final rounding: one-ulp bf16 flips alone are 3.9e-3 relative.
    want = sparse_decode_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode_gpu(*args, **kw, out_dtype=jnp.float32, **tiling, interpret=not ON_GPU)
    assert got.dtype == want.dtype == jnp.float32 and got.shape == want.shape
    assert_close(np.asarray(got), np.asarray(want), rtol=2e-3 if args[0].dtype == jnp.bfloat16 else 1e-5)
    assert sparse_decode_gpu(*args, **kw, **tiling, interpret=not ON_GPU).dtype == args[0].dtype


@pytest.mark.parametrize("seed,kv_dtype,picks", [(10, "fp4", True), (11, "fp8", False)])
def test_prefill_kernel_matches_reference(seed, kv_dtype, picks):
    """C queries per slot, each with its own window range (some empty) and its own entries: a prefix
    (HCA) or picks with -1 holes (CSA), all reading their slot's rows."""
    b, c, h, d, wn, t, k = 2, 5, 16, 128, 40, 90, 24
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, c, h, d)) * 2, jnp.bfloat16)
    window = stored(jnp.asarray(rng.normal(size=(b, wn, d)), jnp.bfloat16), kv_dtype, 64)
    entries = stored(jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16), kv_dtype, 64)
    start = rng.integers(0, wn, size=(b, c))
    end = np.minimum(start + rng.integers(0, 20, size=(b, c)), wn)
    end[0, 0] = start[0, 0]  # a query that sees no window row
    kw = {}
    if picks:
        idx = rng.integers(0, t, size=(b, c, k))
        idx[rng.random((b, c, k)) < 0.3] = -1
        idx[1, 2] = -1
        kw["idx_bck"] = jnp.asarray(idx, jnp.int32)
    else:
        n = rng.integers(0, t + 1, size=(b, c))
        kw["entries_len_bc"] = jnp.asarray(n, jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32)
    args = (q, window, jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32), entries, sinks, d ** -0.5)
    want = sparse_prefill_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_prefill_gpu(*args, **kw, out_dtype=jnp.float32, block_h=16, interpret=not ON_GPU)
    assert got.shape == (b, c, h, d)
    assert_close(np.asarray(got), np.asarray(want), rtol=2e-3)


@pytest.mark.parametrize("tiling", [{"block_k": 16}, {"block_k": 16, "num_splits": 3}])
def test_picks_that_end_early_match_the_reference(tiling):
    """Rows whose picks end early (top-k puts the −1s last: a query early in a prompt has few entries to
    pick) attend only the blocks up to their last pick: rows of 0, 1, 17 and all 96 picks, with holes
    before the last, still give the reference's result, also with the blocks shared among splits."""
    args, kw = inputs(20, "fp8", b=4, w=128, t=300, k=96)
    idx = np.array(kw["idx_bk"])
    rng = np.random.default_rng(21)
    for row, n_live in enumerate([0, 1, 17, 96]):
        idx[row] = np.where(np.arange(96) < n_live, rng.permutation(300)[:96], -1)
    idx[2, 3] = -1
    kw = {"idx_bk": jnp.asarray(idx, jnp.int32)}
    want = sparse_decode_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode_gpu(*args, **kw, out_dtype=jnp.float32, **tiling, interpret=not ON_GPU)
    assert_close(np.asarray(got), np.asarray(want), rtol=2e-3)
