"""FP4 code layouts: repacking keeps every code, its decode equals the checkpoint order's, and it undoes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.expert_matmul.fp4_codes import (fp16_pairs, in_checkpoint_layout, repack_codes,
                                                   unrepack_codes)
from dsjax.quant import dequantize_fp4


def _words():
    """Every code value alone at every position of a word, then random words."""
    alone = np.arange(16, dtype=np.uint32)[:, None] << (4 * np.arange(8, dtype=np.uint32))  # [value, position]
    random = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint32)
    return jnp.asarray(np.concatenate([alone.reshape(-1), random]).view(np.int32))


def _as_words(codes):
    return jax.lax.bitcast_convert_type(codes.reshape(-1, 4), jnp.int32)


def test_repacked_codes_decode_to_the_checkpoints_fp16_pairs():
    words = _words()
    as_bytes = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1, 64)
    repacked = _as_words(repack_codes(as_bytes))
    assert not np.array_equal(repacked, words)
    for p, (want, got) in enumerate(zip(fp16_pairs(words), fp16_pairs(repacked, "repacked"))):
        np.testing.assert_array_equal(got, want, err_msg=f"pair {p}")


def test_checkpoint_pairs_are_the_codes_as_fp16():
    """Pair p of a word: codes p (low half) and p + 4 (high half) as fp16 `e2m1 · 2^-14`, exactly."""
    words = _words()
    codes = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1, 4)
    values = np.asarray(dequantize_fp4(codes, jnp.full((codes.shape[0], 1), 127, jnp.uint8), jnp.float32))
    values = values.reshape(-1, 8)  # [word, code]: a scale of 2^0
    for p, both in enumerate(fp16_pairs(words)):
        halves = np.asarray(jax.lax.bitcast_convert_type(both, jnp.float16), np.float32)  # [word, 2]
        np.testing.assert_array_equal(halves * 2.0 ** 14, values[:, [p, p + 4]], err_msg=f"pair {p}")


@pytest.mark.parametrize("shape", [(4,), (3, 64), (2, 5, 3, 8)])
def test_unrepack_undoes_repack_bit_for_bit(shape):
    w = jnp.asarray(np.random.default_rng(1).integers(-128, 128, shape), jnp.int8)
    repacked = repack_codes(w)
    assert repacked.shape == w.shape and repacked.dtype == w.dtype
    np.testing.assert_array_equal(unrepack_codes(repacked), w)
    np.testing.assert_array_equal(in_checkpoint_layout(repacked, "repacked"), w)
    assert in_checkpoint_layout(w, "checkpoint") is w


def test_codes_that_are_not_whole_words_and_unknown_layouts_are_refused():
    with pytest.raises(ValueError, match=r"repack_codes: .* multiple of 4 .* got uint8 \(2, 6\)"):
        repack_codes(jnp.zeros((2, 6), jnp.uint8))
    with pytest.raises(ValueError, match="unrepack_codes: FP4 codes are bytes"):
        unrepack_codes(jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="code_layout must be one of .* got 'marlin'"):
        in_checkpoint_layout(jnp.zeros((2, 8), jnp.int8), "marlin")
