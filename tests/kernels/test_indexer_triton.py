"""The lightning indexer's scores (decode and prefill chunks): the Pallas GPU kernel (interpreted on CPU, native on a GPU)
against the pure-JAX reference on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.cache_formats import Records
from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.indexer.reference import index_scores_chunk_reference, index_scores_reference
from dsjax.kernels.indexer.triton import fuses, index_scores_chunk_gpu, index_scores_gpu
from dsjax.quant import pack_kv
from tests.helpers import assert_close

ON_GPU = jax.default_backend() == "gpu"


def inputs(seed, kv_dtype="fp8", b=3, h=16, c=64, t=300, dtype=jnp.bfloat16, group=64):
    """`kv_dtype`: "fp8" (V4's PackedKV), "mxfp4" (V4.1's index key records), a float dtype's name."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, c)), dtype)
    w = jnp.asarray(rng.normal(size=(b, h)), jnp.float32)  # head weights of both signs
    keys = jnp.asarray(rng.normal(size=(b, t, c)), jnp.bfloat16 if kv_dtype != "float32" else jnp.float32)
    if kv_dtype == "fp8":
        keys = pack_kv(keys, "fp8", 0, group)
    elif kv_dtype == "mxfp4":
        keys = Records.of(keys, "mxfp4")
    n = rng.integers(1, t + 1, size=b)
    n[0] = 0
    return q, w, keys, jnp.asarray(n, jnp.int32), c ** -0.5


@pytest.mark.parametrize("seed,kv_dtype,shape,tiling", [
    (0, "fp8", {}, {}), (1, "fp8", {"c": 128, "t": 1000, "group": 128}, {"block_t": 32, "tiles": 4}),
    (2, "bfloat16", {}, {"tiles": 2}), (3, "float32", {"dtype": jnp.float32, "b": 2}, {})])
def test_kernel_matches_reference(seed, kv_dtype, shape, tiling):
    args = inputs(seed, kv_dtype, **shape)
    want = np.asarray(index_scores_reference(*args))
    got = np.asarray(index_scores_gpu(*args, **tiling, interpret=not ON_GPU))
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # exactly the keys past each slot's count
    live = ~np.isneginf(want)
    assert_close(got[live], want[live], rtol=2e-3 if kv_dtype != "float32" else 1e-5)


def test_mxfp4_key_records_match_reference():
    """V4.1's MXFP4 index key records (`[64 code bytes | 4 scale bytes]` a key at V4.1's width 128), read
    as stored: the same scores as the reference's over the dequantized keys."""
    args = inputs(4, "mxfp4", c=128)
    want = np.asarray(index_scores_reference(*args))
    got = np.asarray(index_scores_gpu(*args, interpret=not ON_GPU))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    live = ~np.isneginf(want)
    assert_close(got[live], want[live], rtol=2e-3)


def test_v4_fp4_keys_are_refused():
    q, w, keys, n, scale = inputs(4)
    with pytest.raises(CannotTile, match="fp8 or float, got fp4"):
        index_scores_gpu(q, w, pack_kv(jnp.zeros((3, 300, 64)), "fp4", 0), n, scale, interpret=True)


def test_records_it_does_not_read_are_refused():
    q, w, _, n, scale = inputs(4, "bfloat16")
    for keys, message in ((Records.of(jnp.zeros((3, 300, 64)), "mxfp8"), "mxfp8 records of 64 channels"),
                          (Records.of(jnp.zeros((3, 300, 96)), "mxfp4"), "mxfp4 records of 96 channels")):
        with pytest.raises(CannotTile, match=message):
            index_scores_gpu(q[..., :keys.dim], w, keys, n, scale, interpret=True)


@pytest.mark.parametrize("magnitude", [1e6, 1e-7])
def test_fp8_keys_take_queries_beyond_fp16s_range(magnitude):
    """fp8 keys multiply on fp16 tensor cores; queries far outside fp16's range (it overflows at 65504
    and rounds below 6e-5) still give the reference's scores, since each head's row is scaled by a power
    of two first. Heads of different magnitudes share a program."""
    q, w, keys, n, scale = inputs(5, "fp8", c=128, group=64)
    q = q * jnp.asarray(np.geomspace(1.0, magnitude, q.shape[1]), jnp.bfloat16)[None, :, None]
    want = np.asarray(index_scores_reference(q, w, keys, n, scale))
    got = np.asarray(index_scores_gpu(q, w, keys, n, scale, interpret=not ON_GPU))
    live = ~np.isneginf(want)
    assert np.isfinite(got[live]).all()
    assert_close(got[live], want[live], rtol=1e-5)


def chunk_inputs(seed, kv_dtype="bfloat16", b=2, c_len=7, h=16, c=64, t=300, dtype=jnp.bfloat16, group=64):
    """A chunk of `c_len` queries per slot at consecutive positions, each seeing a prefix of the keys (as
    prefill does: later queries see more), the first slot's first queries none."""
    q, w, keys, _, scale = inputs(seed, kv_dtype, b=b * c_len, h=h, c=c, t=t, dtype=dtype, group=group)
    keys = jax.tree.map(lambda x: x[:b], keys)
    rng = np.random.default_rng(seed + 100)
    start = rng.integers(0, t, size=b)
    lens = np.minimum(start[:, None] + np.arange(c_len)[None, :] - 2, t).clip(0)
    lens[0, :3] = 0
    return (q.reshape(b, c_len, h, c), w.reshape(b, c_len, h), keys, jnp.asarray(lens, jnp.int32), scale)


@pytest.mark.parametrize("seed,kv_dtype,shape,tiling", [
    (0, "bfloat16", {}, {}), (1, "bfloat16", {"c_len": 16, "t": 700}, {"block_q": 8, "block_t": 32, "tiles": 4}),
    (2, "fp8", {"c": 128, "group": 128}, {"block_q": 2}), (3, "float32", {"dtype": jnp.float32}, {"block_q": 8}),
    (4, "mxfp4", {"c": 128, "h": 32}, {"block_q": 4})])
@pytest.mark.parametrize("fuse", [True, False])
def test_chunk_kernel_matches_reference(seed, kv_dtype, shape, tiling, fuse):
    """A prefill chunk's scores: each query block reads a key block once for all its queries (one product
    of all their heads, or one per query); the chunk's length need not divide into query blocks (7
    queries in blocks of 2 or 4, or one block of 8)."""
    args = chunk_inputs(seed, kv_dtype, **shape)
    want = np.asarray(index_scores_chunk_reference(*args))
    got = np.asarray(index_scores_chunk_gpu(*args, **tiling, fuse=fuse, interpret=not ON_GPU))
    assert got.shape == want.shape == (*args[0].shape[:2], jax.tree.leaves(args[2])[0].shape[1])
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    live = ~np.isneginf(want)
    assert live.any() and (~live).any()
    assert_close(got[live], want[live], rtol=2e-3 if kv_dtype != "float32" else 1e-5)


@pytest.mark.parametrize("magnitude", [1e6, 1e-7])
@pytest.mark.parametrize("kv_dtype,fuse", [("fp8", True), ("mxfp4", True), ("mxfp4", False)])
def test_fused_chunk_scales_each_query_and_head_on_its_own(magnitude, kv_dtype, fuse):
    """With fp8 keys or V4.1's MXFP4 key records, the product's rows are every (query, head) of a block, each
    scaled by its own power of two for fp16 (and the fp4 codes taken as `e2m1 · 2^-14`): queries of a block far
    apart in magnitude still give the reference's scores, to fp32's summation order."""
    q, w, keys, lens, scale = chunk_inputs(7, kv_dtype, c_len=8, c=128, **({"group": 64} if kv_dtype == "fp8" else {}))
    q = q * jnp.asarray(np.geomspace(1.0, magnitude, 8 * q.shape[2]).reshape(8, -1), jnp.bfloat16)[None, :, :, None]
    want = np.asarray(index_scores_chunk_reference(q, w, keys, lens, scale))
    got = np.asarray(index_scores_chunk_gpu(q, w, keys, lens, scale, block_q=4, fuse=fuse, interpret=not ON_GPU))
    live = ~np.isneginf(want)
    np.testing.assert_array_equal(np.isneginf(got), ~live)
    assert np.isfinite(got[live]).all()
    assert_close(got[live], want[live], rtol=1e-5)


def test_fusing_by_default_where_the_product_is_at_most_128_rows():
    """V4.1's 32 index heads fuse 4 queries (128 rows, faster on an H200); V4's 64 do not (256 rows,
    slower); one query (decode) never does. The default gives the explicit choice's scores."""
    assert fuses(4, 32) and fuses(2, 64) and fuses(8, 16)
    assert not fuses(4, 64) and not fuses(8, 32) and not fuses(1, 32)
    args = chunk_inputs(4, "bfloat16")
    got = np.asarray(index_scores_chunk_gpu(*args, block_q=4, interpret=not ON_GPU))
    want = np.asarray(index_scores_chunk_gpu(*args, block_q=4, fuse=fuses(4, args[0].shape[2]), interpret=not ON_GPU))
    np.testing.assert_array_equal(got, want)


def test_decode_is_a_chunk_of_one():
    q, w, keys, n, scale = inputs(6, "bfloat16")
    want = np.asarray(index_scores_chunk_reference(q[:, None], w[:, None], keys, n[:, None], scale))[:, 0]
    np.testing.assert_array_equal(np.asarray(index_scores_reference(q, w, keys, n, scale)), want)


def test_under_a_mesh_the_op_runs_on_each_devices_slots():
    """Under a mesh of 8 devices the op runs in a shard_map over the slot axes, so the kernel can run:
    lowered for cuda it is there; interpreted on the CPU devices, the reference's scores."""
    from dsjax.kernels.indexer.op import index_scores
    from dsjax.parallel.mesh import make_mesh
    from tests.helpers import mesh_cuda_module

    q, w, keys, n, scale = chunk_inputs(5, kv_dtype="bfloat16", b=8, c_len=3)
    text = mesh_cuda_module(lambda *a: index_scores(*a, scale), q, w, keys, n)
    assert "__gpu$xla.gpu.triton" in text
    with jax.set_mesh(make_mesh("dp=2,ep=4")):
        got = jax.jit(lambda *a: index_scores(*a, scale, kernels="interpret"))(q, w, keys, n)
    want = index_scores_chunk_reference(q, w, keys, n, scale)
    finite = np.isfinite(np.asarray(want))
    assert np.array_equal(finite, np.isfinite(np.asarray(got)))
    assert_close(np.asarray(got)[finite], np.asarray(want)[finite], rtol=2e-2)


@pytest.mark.parametrize("kv_dtype,shape,block_q", [
    ("float32", {"dtype": jnp.float32}, 8), ("mxfp4", {"c": 128, "h": 32}, 4), ("fp8", {"c": 128, "group": 128}, 2)])
@pytest.mark.parametrize("fuse", [True, False])
def test_chunk_kernel_lowers_for_cuda(kv_dtype, shape, block_q, fuse):
    """The interpreter runs what Triton's lowering refuses (a block of 3 queries did, natively): each
    chunk case lowered for cuda, as on a GPU."""
    from dsjax.export import abstract_device, disabled_checks

    *args, scale = chunk_inputs(4, kv_dtype, **shape)
    fn = jax.jit(lambda *a: index_scores_chunk_gpu(*a, scale, block_q=block_q, fuse=fuse))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))):
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(*args).mlir_module()
    assert "dsjax_index_scores" in text


def test_chunk_blocks_that_are_not_powers_of_two_are_refused():
    args = chunk_inputs(0)
    with pytest.raises(CannotTile, match="block_q must be a power of two .* got 3"):
        index_scores_chunk_gpu(*args, block_q=3, interpret=True)
