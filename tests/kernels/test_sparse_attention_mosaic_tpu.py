"""The Mosaic TPU sparse attention kernels (decode, prefill), run on CPU by the TPU interpreter, against
the pure-JAX references on fresh random inputs for every cache storage; their lowering for TPU
(`jax.export` to platform "tpu"); the exact bit-level decoders they (and the indexer's TPU kernel)
dequantize with.

The TPU interpreter is slow: shapes are small and each storage has one or two cases."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from dsjax.kernels.dispatch import CannotTile
from dsjax.kernels.sparse_attention.mosaic_tpu import (e2m1_to_f32, e4m3_to_f32, scales_to_f32, sparse_decode_tpu,
                                                        sparse_prefill_tpu)
from dsjax.kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference
from dsjax.quant import E2M1_VALUES, pack_kv, ue8m0_to_float
from tests.helpers import assert_close

INTERPRET = pltpu.InterpretParams()
# Jitted: op-by-op they compile every primitive for every shape, which costs more than the kernels.
pack = jax.jit(pack_kv, static_argnums=(1, 2, 3))
attention_reference = jax.jit(sparse_decode_reference, static_argnames=("scale", "out_dtype"))
prefill_reference = jax.jit(sparse_prefill_reference, static_argnames=("scale", "out_dtype"))


def rtol_for(q):
    return 2e-3 if q.dtype == jnp.bfloat16 else 1e-5


def case_id(*parts):
    *names, options = parts
    return "-".join([*names, *(f"{k}={getattr(v, '__name__', v)}" for k, v in options.items())])


# ------------------------------------------------------------------------------ sparse attention
def attention_inputs(seed, kv_dtype, mode, *, b=2, h=16, d=128, rd=64, w=32, t=64, k=32, dtype=jnp.bfloat16):
    """Slot 0 sees no window key; the last slot has no valid pick (CSA) or no entry (HCA). Picks are
    distinct with -1 holes; sinks of both signs; keys RMS-scale rows, as the model's are."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, d)) * 2, dtype)
    rows = jnp.asarray(rng.normal(size=(b, w + t, d)), jnp.bfloat16)  # window rows, then entries
    if kv_dtype != "bfloat16":
        rows = pack(rows, kv_dtype, rd, 64)
    window, entries = jax.tree.map(lambda a: a[:, :w], rows), jax.tree.map(lambda a: a[:, w:], rows)
    window_len = rng.integers(1, w + 1, size=b)
    window_len[0] = 0
    kw = {}
    if mode == "picks":
        idx = np.stack([rng.permutation(t)[:k] for _ in range(b)])
        idx[rng.random((b, k)) < 0.3] = -1
        idx[-1] = -1
        kw["idx_bk"] = jnp.asarray(idx, jnp.int32)
    elif mode == "prefix":
        n = rng.integers(1, t + 1, size=b)
        n[-1] = 0
        kw["entries_len_b"] = jnp.asarray(n, jnp.int32)
    else:
        entries = None
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32)
    return (q, window, jnp.asarray(window_len, jnp.int32), entries, sinks, d ** -0.5), kw


ATTENTION_CASES = [
    # (storage, entries, shape, tiling)
    ("bfloat16", "picks", {"k": 48}, {"block_k": 16}),  # two window blocks, three gather blocks (double buffer)
    ("fp8", "picks", {"k": 24}, {}),  # picks padded to a block
    ("fp4", "picks", {"dtype": jnp.float32}, {}),
    ("fp4", "prefix", {"w": 16}, {"block_k": 32}),  # two contiguous entry blocks
    ("bfloat16", "prefix", {"dtype": jnp.float32}, {}),
    ("fp8", "none", {"dtype": jnp.float32}, {}),  # sliding-window layer
    ("fp8", "prefix", {}, {"block_h": 8}),  # two head blocks
]


@pytest.mark.parametrize("seed,case", list(enumerate(ATTENTION_CASES)),
                         ids=[case_id(*c[:2], {**c[2], **c[3]}) for c in ATTENTION_CASES])
def test_sparse_decode_matches_reference(seed, case):
    kv_dtype, mode, shape, tiling = case
    args, kw = attention_inputs(seed, kv_dtype, mode, **shape)
    # Compared before the output's final rounding: one-ulp bf16 flips alone are 3.9e-3 relative.
    want = attention_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_decode_tpu(*args, **kw, out_dtype=jnp.float32, **tiling, interpret=INTERPRET)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_close(np.asarray(got), np.asarray(want), rtol=rtol_for(args[0]), what=f"{kv_dtype} {mode}")
    default = jax.eval_shape(functools.partial(sparse_decode_tpu, scale=args[-1], **kw, **tiling,
                                               interpret=INTERPRET), *args[:-1])
    assert default.dtype == args[0].dtype and default.shape == want.shape


@pytest.mark.parametrize("kv_dtype,mode", [("fp8", "picks"), ("fp4", "prefix"), ("bfloat16", "none")])
def test_sparse_decode_lowers_for_tpu(kv_dtype, mode):
    args, kw = attention_inputs(0, kv_dtype, mode)
    fn = jax.jit(functools.partial(sparse_decode_tpu, scale=args[-1]))
    exported = jax.export.export(fn, platforms=["tpu"])(*args[:-1], **kw)
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()


def test_sparse_decode_refuses_untileable_shapes():
    args, kw = attention_inputs(0, "bfloat16", "picks", w=48)
    with pytest.raises(CannotTile, match="48 window rows cannot be tiled"):
        sparse_decode_tpu(*args, **kw, block_k=32, interpret=INTERPRET)
    args, kw = attention_inputs(0, "bfloat16", "prefix", h=12)
    with pytest.raises(CannotTile, match="block_h"):
        sparse_decode_tpu(*args, **kw, block_h=8, interpret=INTERPRET)
    with pytest.raises(CannotTile, match="bfloat16 or float32"):
        sparse_decode_tpu(args[0].astype(jnp.float16), *args[1:], **kw, interpret=INTERPRET)


def test_sparse_decode_raises_other_errors_as_they_are():
    """Arguments no kernel takes are not a tiling matter: plain ValueErrors, which `dispatch` lets through."""
    args, kw = attention_inputs(0, "bfloat16", "prefix")
    for bad in ({}, {**kw, "block_k": 0}):
        with pytest.raises(ValueError) as err:
            sparse_decode_tpu(*args, **bad, interpret=INTERPRET)
        assert not isinstance(err.value, CannotTile)


@pytest.mark.parametrize("kv_dtype,mode,wn,tiling", [("fp8", "picks", 64, {"block_k": 32}),
                                                     ("fp4", "prefix", 32, {})])
def test_sparse_prefill_matches_reference(kv_dtype, mode, wn, tiling):
    """C queries per slot, each with its own window range [start, end) (one empty, one across two
    window blocks with block_k 32) and its own picks with -1 holes (CSA) or entry count (HCA)."""
    b, c, h, d, t, k = 2, 3, 8, 128, 64, 24
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(b, c, h, d)) * 2, jnp.bfloat16)
    rows = pack(jnp.asarray(rng.normal(size=(b, wn + t, d)), jnp.bfloat16), kv_dtype, 64, 64)
    window, entries = jax.tree.map(lambda a: a[:, :wn], rows), jax.tree.map(lambda a: a[:, wn:], rows)
    start = rng.integers(0, wn, size=(b, c))
    end = np.minimum(start + rng.integers(1, 20, size=(b, c)), wn)
    end[0, 0] = start[0, 0]  # sees no window row
    start[1, 1], end[1, 1] = 20, 50 if wn == 64 else 30  # crosses a block boundary (wn = 64)
    kw = {}
    if mode == "picks":
        idx = np.stack([[rng.permutation(t)[:k] for _ in range(c)] for _ in range(b)])
        idx[rng.random((b, c, k)) < 0.3] = -1
        idx[1, 2] = -1
        kw["idx_bck"] = jnp.asarray(idx, jnp.int32)
    else:
        kw["entries_len_bc"] = jnp.asarray(rng.integers(0, t + 1, size=(b, c)), jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32)
    args = (q, window, jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32), entries, sinks, d ** -0.5)
    want = prefill_reference(*args, **kw, out_dtype=jnp.float32)
    got = sparse_prefill_tpu(*args, **kw, out_dtype=jnp.float32, **tiling, interpret=INTERPRET)
    assert got.shape == (b, c, h, d)
    assert_close(np.asarray(got), np.asarray(want), rtol=2e-3, what=f"{kv_dtype} {mode}")
    exported = jax.export.export(jax.jit(functools.partial(sparse_prefill_tpu, scale=args[-1], **tiling)),
                                 platforms=["tpu"])(*args[:-1], **kw)
    assert "dsjax_sparse_prefill_tpu" in exported.mlir_module()


# ------------------------------------------------------------------------------------- decoders
def test_bit_decoders_are_exact():
    byte = jnp.arange(256, dtype=jnp.int32)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e4m3_to_f32(byte)), want)
    np.testing.assert_array_equal(np.signbit(np.asarray(e4m3_to_f32(byte))), np.signbit(want))
    np.testing.assert_array_equal(np.asarray(e2m1_to_f32(jnp.arange(16, dtype=jnp.int32))), E2M1_VALUES)
    u8 = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(scales_to_f32(u8)), np.asarray(ue8m0_to_float(u8)))
