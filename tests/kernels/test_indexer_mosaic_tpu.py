"""The Mosaic TPU indexer scores kernel, for decode and prefill chunks, run on CPU by the TPU interpreter,
against the pure-JAX reference on fresh random inputs for every key storage; its lowering for TPU
(`jax.export` to platform "tpu"), also through the op; what it refuses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.indexer.mosaic_tpu import index_scores_chunk_tpu, index_scores_tpu
from dsjax.kernels.indexer.op import index_scores
from dsjax.kernels.indexer.reference import index_scores_chunk_reference, index_scores_reference
from dsjax.quant import pack_kv
from tests.helpers import assert_close
from tests.kernels.test_sparse_attention_mosaic_tpu import INTERPRET, case_id, pack, rtol_for

index_reference = jax.jit(index_scores_reference, static_argnames=("scale",))


def index_inputs(seed, keys, *, b=2, h=16, c=128, t=64, dtype=jnp.bfloat16, group=128, rd=0):
    """Slot 0 has no key; the others a random count."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, c)), dtype)
    weights = jnp.asarray(rng.normal(size=(b, h)), jnp.float32)
    k = rng.normal(size=(b, t, c))
    k = pack(jnp.asarray(k, jnp.float32), "fp8", rd, group) if keys == "fp8" else jnp.asarray(k, keys)
    keys_len = rng.integers(1, t + 1, size=b)
    keys_len[0] = 0
    return q, weights, k, jnp.asarray(keys_len, jnp.int32), c ** -0.5


def assert_scores_match(got, want, q, what: str) -> np.ndarray:
    """The kernel's fp32 scores are −inf exactly where the reference's are, and close elsewhere; returns
    where they are finite."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    visible = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), visible)
    assert (got[~visible] == -np.inf).all()
    assert_close(got[visible], want[visible], rtol=rtol_for(q), what=what)
    return visible


INDEX_CASES = [
    ("bfloat16", {}, {}),
    ("float32", {"dtype": jnp.float32, "t": 256}, {"block_t": 128}),  # a block past a slot's keys is skipped
    ("float32", {}, {}),  # bf16 queries, fp32 keys: an fp32 dot
    ("fp8", {"group": 64}, {}),  # two scale groups
    ("fp8", {"dtype": jnp.float32}, {}),
]


@pytest.mark.parametrize("seed,case", list(enumerate(INDEX_CASES)),
                         ids=[case_id(c[0], {**c[1], **c[2]}) for c in INDEX_CASES])
def test_index_scores_match_reference(seed, case):
    keys, shape, tiling = case
    args = index_inputs(seed, keys, **shape)
    got = index_scores_tpu(*args, **tiling, interpret=INTERPRET)
    visible = assert_scores_match(got, index_reference(*args), args[0], keys)
    assert not visible[0].any() and visible.any()


@pytest.mark.parametrize("keys", ["fp8", "bfloat16"])
def test_index_scores_lower_for_tpu(keys):
    q, weights, k, keys_len, scale = index_inputs(0, keys)
    fn = jax.jit(functools.partial(index_scores_tpu, scale=scale))
    exported = jax.export.export(fn, platforms=["tpu"])(q, weights, k, keys_len)
    assert "tpu_custom_call" in exported.mlir_module()


def test_index_scores_refuse_fp4_keys_and_untileable_blocks():
    q, weights, _, keys_len, scale = index_inputs(0, "bfloat16")
    fp4 = pack_kv(jnp.zeros((2, 64, 128), jnp.float32), "fp4", 0)
    with pytest.raises(CannotTile, match="fp4"):
        index_scores_tpu(q, weights, fp4, keys_len, scale, interpret=INTERPRET)
    args = index_inputs(0, "bfloat16", t=256)
    with pytest.raises(CannotTile, match="block_t=100"):
        index_scores_tpu(*args, block_t=100, interpret=INTERPRET)


def test_index_scores_raise_malformed_keys_as_they_are():
    q, weights, keys, keys_len, scale = index_inputs(0, "bfloat16")
    with pytest.raises(ValueError, match="must have 128 channels") as err:
        index_scores_tpu(q, weights, keys[..., :64], keys_len, scale, interpret=INTERPRET)
    assert not isinstance(err.value, CannotTile)


chunk_reference = jax.jit(index_scores_chunk_reference, static_argnames=("scale",))


def chunk_inputs(seed, keys, *, b=2, c_len=24, h=8, c=128, t=384, dtype=jnp.bfloat16, group=128, rd=0):
    """A prefill chunk: each query sees the keys up to its own length (growing through the chunk as a
    causal chunk's do, with a random start); slot 0's first queries see none."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, c_len, h, c)), dtype)
    weights = jnp.asarray(rng.normal(size=(b, c_len, h)), jnp.float32)
    k = rng.normal(size=(b, t, c))
    k = pack(jnp.asarray(k, jnp.float32), "fp8", rd, group) if keys == "fp8" else jnp.asarray(k, keys)
    start = rng.integers(0, t - c_len, size=(b, 1))
    start[0] = -8
    keys_len = np.clip(start + np.arange(1, c_len + 1) * rng.integers(1, 8), 0, t)
    return q, weights, k, jnp.asarray(keys_len, jnp.int32), c ** -0.5


CHUNK_CASES = [
    ("bfloat16", {}, {"block_q": 8, "block_t": 128}),     # three query blocks by three key blocks
    ("float32", {"dtype": jnp.float32, "c_len": 32}, {"block_q": 16, "block_t": 128}),
    ("bfloat16", {"c_len": 5, "t": 64}, {}),              # one block each way, smaller than the defaults
    ("fp8", {"group": 64, "rd": 64, "c": 192}, {"block_q": 8, "block_t": 128}),  # scale groups and a rotary slice
]


@pytest.mark.parametrize("seed,case", list(enumerate(CHUNK_CASES)),
                         ids=[case_id(c[0], {**c[1], **c[2]}) for c in CHUNK_CASES])
def test_chunk_scores_match_reference(seed, case):
    keys, shape, tiling = case
    args = chunk_inputs(seed, keys, **shape)
    got = index_scores_chunk_tpu(*args, **tiling, interpret=INTERPRET)
    visible = assert_scores_match(got, chunk_reference(*args), args[0], keys)
    assert not visible[0, 0].any() and visible.any() and (~visible).any()


def test_chunk_scores_refuse_untileable_query_blocks():
    args = chunk_inputs(0, "bfloat16")
    with pytest.raises(CannotTile, match="block_q=12"):
        index_scores_chunk_tpu(*args, block_q=12, interpret=INTERPRET)
    with pytest.raises(CannotTile, match="block_q=16"):  # 24 queries
        index_scores_chunk_tpu(*args, block_q=16, interpret=INTERPRET)


def test_the_op_lowers_chunks_to_the_tpu_kernel():
    """The indexer op on a prefill chunk, lowered for TPU, runs the kernel (not the reference)."""
    q, weights, k, keys_len, scale = chunk_inputs(0, "bfloat16")
    fn = jax.jit(functools.partial(index_scores, scale=scale))
    exported = jax.export.export(fn, platforms=["tpu"])(q, weights, k, keys_len)
    assert "tpu_custom_call" in exported.mlir_module()
