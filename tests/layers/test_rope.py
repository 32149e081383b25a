"""Rotary tables (plain and YaRN) against the reference, and the interleaved trailing-slice layout."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import ModelConfig
from dsjax.layers.rope import apply_rope, inv_freq, rope_table
from tests.reference.spec import CONFIGS


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_inv_freq_matches_reference(reference, i):
    ref = json.loads((reference / "configs.json").read_text())[i]
    cfg = ModelConfig.from_hf(CONFIGS[i])
    np.testing.assert_allclose(inv_freq(cfg.rope_main, cfg.head_dim), ref["inv_freq_main"], rtol=1e-6)
    np.testing.assert_allclose(inv_freq(cfg.rope_compress, cfg.head_dim), ref["inv_freq_compress"], rtol=1e-6)
    assert cfg.rope_main.scaling() == pytest.approx(ref["scaling_main"])
    assert cfg.rope_compress.scaling() == pytest.approx(ref["scaling_compress"])


def test_rope_rotates_trailing_pairs_interleaved():
    cfg = ModelConfig.preset("tiny")
    rd = cfg.qk_rope_head_dim
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, cfg.head_dim)), jnp.float32)
    cos, sin = rope_table(cfg.rope_main, cfg.head_dim, jnp.arange(3)[None], jnp.float32)
    y = np.asarray(apply_rope(x, cos, sin))
    np.testing.assert_array_equal(y[..., :-rd], np.asarray(x)[..., :-rd])  # nope channels untouched
    a, b = np.asarray(x)[..., -rd::2], np.asarray(x)[..., -rd + 1::2]
    c, s = np.asarray(cos), np.asarray(sin)
    np.testing.assert_allclose(y[..., -rd::2], a * c - b * s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y[..., -rd + 1::2], b * c + a * s, rtol=1e-6, atol=1e-7)
    back = np.asarray(apply_rope(jnp.asarray(y), cos, -sin))
    np.testing.assert_allclose(back, np.asarray(x), atol=1e-6)
