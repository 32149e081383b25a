"""The cache layout, and chunked prefill through it against one-shot prefill and the no-cache forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.cache import cache_bytes_per_token, init_cache
from dsjax.config import CSA, HCA, SLIDING, ModelConfig
from tests.helpers import assert_close


@pytest.mark.parametrize("case", ["mixed", "legacy"])
def test_chunked_prefill_equals_one_shot_and_no_cache(load_case, case):
    model = load_case(case)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(3)
    lengths = np.asarray([45, 13])
    ids = rng.integers(0, model.cfg.vocab_size, (2, 48)).astype(np.int32)

    @jax.jit
    def run_chunk(params, cache, tokens, start, n_valid):
        m = nnx.merge(graphdef, params)
        hidden, cache = m.extend(tokens, cache, start, n_valid)
        return m.logits(hidden), cache

    def prefill(chunk):
        cache, outs = init_cache(model, 2, 64), []
        for k in range(0, 48, chunk):
            n_valid = np.clip(lengths - k, 0, chunk)
            logits, cache = run_chunk(params, cache, jnp.asarray(ids[:, k:k + chunk]),
                                      jnp.asarray(np.minimum(k, lengths)), jnp.asarray(n_valid))
            outs.append(np.asarray(logits))
        return np.concatenate(outs, axis=1), cache

    chunked, cache_c = prefill(12)
    one_shot, cache_o = prefill(48)
    for b, n in enumerate(lengths):
        full = np.asarray(model(jnp.asarray(ids[b:b + 1, :n])))[0]
        assert_close(chunked[b, :n], full, rtol=1e-5, what=f"row {b} chunked")
        assert_close(one_shot[b, :n], full, rtol=1e-5, what=f"row {b} one-shot")
    np.testing.assert_array_equal(np.asarray(cache_c.lengths), lengths)
    # Both caches must continue identically (their unused buffer slots may differ).
    nxt = jnp.asarray([[5], [7]], jnp.int32)
    one = jnp.ones(2, jnp.int32)
    after_c, _ = run_chunk(params, cache_c, nxt, jnp.asarray(lengths), one)
    after_o, _ = run_chunk(params, cache_o, nxt, jnp.asarray(lengths), one)
    assert_close(after_c, after_o, rtol=1e-5, what="decode after chunked vs one-shot prefill")


def test_cache_shapes_follow_max_len():
    cfg = ModelConfig.preset("tiny")
    from dsjax.model import DeepseekV4
    model = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: init_cache(model, 3, 64, jnp.bfloat16))
    by_type = {}
    for meta, group in zip(model.groups_meta, cache.groups):
        for (attn, _), layer in zip(meta.pattern, group):
            by_type[attn] = layer
    assert by_type[SLIDING].window.shape == (1, 3, cfg.sliding_window, cfg.head_dim)
    assert by_type[SLIDING].compressor is None
    assert by_type[HCA].compressor.entries.shape == (1, 3, 64 // cfg.compress_rate_hca, cfg.head_dim)
    assert by_type[HCA].compressor.overlap_kv is None
    assert by_type[CSA].indexer.entries.shape == (1, 3, 64 // cfg.compress_rate_csa, cfg.index_head_dim)
    assert by_type[CSA].compressor.overlap_kv.shape == (1, 3, cfg.compress_rate_csa, cfg.head_dim)
    per_token = cache_bytes_per_token(cfg, 64)
    assert per_token[CSA] > per_token[HCA] > 0 and per_token[SLIDING] > 0
