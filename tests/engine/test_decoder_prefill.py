"""DeepSeek-V4.1's causal encoder-decoder prefill: the decoder layers run only on a prompt's last
`decoder_keep` positions ("exact": bit for bit the caches and logits of running every layer on every token),
or DeepInfer's approximate bounded replay ("replay"), measured against the exact form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax import Engine, RunConfig, SamplingParams
from dsjax.cache import init_cache
from dsjax.config_v41 import V41Config
from dsjax.model_v41 import DeepseekV41, decoder_keep, replay_keep, with_cache_rounding

CHUNK = 8


@pytest.fixture(scope="module")
def model():
    return with_cache_rounding(DeepseekV41(V41Config.preset("tiny-v4.1"), rngs=nnx.Rngs(1)), True)


_extend = jax.jit(lambda m, t, c, s, n, f, d: m.extend(t, c, s, n, decoder=d, floor_b=f), static_argnums=6)


def prefill(model, ids: np.ndarray, keep: int | None, replay: bool = False):
    """Chunked prefill of one row: chunks wholly before `L − keep` through the encoder only (keep None: none),
    the others whole (with the bounded replay's window floor if `replay`). Returns the last position's logits,
    the cache and how many chunks skipped the decoder."""
    length = ids.shape[1]
    cache = init_cache(model, 1, 128)
    skipped = 0
    for s0 in range(0, length, CHUNK):
        n = min(CHUNK, length - s0)
        tokens = np.zeros((1, CHUNK), np.int32)
        tokens[:, :n] = ids[:, s0:s0 + n]
        decoder = keep is None or s0 + n > length - keep
        skipped += not decoder
        floor = jnp.asarray([length - keep]) if replay and decoder else None
        hidden, cache = _extend(model, jnp.asarray(tokens), cache, jnp.asarray([s0]), jnp.asarray([n]), floor, decoder)
    return np.asarray(model.logits(hidden))[0, n - 1], cache, skipped


def test_keep_is_the_decoders_reach(model):
    cfg = model.cfg
    assert decoder_keep(cfg) == 4 * (8 - 1) + 1  # 4 decoder layers (4-7), windows of 8
    assert decoder_keep(V41Config.preset("v4.1-flash")) == 20 * 127 + 1
    assert replay_keep(V41Config.preset("v4.1-flash")) == 140  # DeepInfer's recommended keep


@pytest.mark.parametrize("length", [61, 70])
def test_exact_truncation_equals_full_prefill(model, length):
    ids = np.random.default_rng(length).integers(3, 250, (1, length))
    full_logits, full_cache, _ = prefill(model, ids, None)
    logits, cache, skipped = prefill(model, ids, decoder_keep(model.cfg))
    assert skipped >= 3
    np.testing.assert_array_equal(logits, full_logits)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_shorter_keep_is_not_exact(model):
    """One decoder position fewer than `decoder_keep` (a chunk boundary placed so) changes the result: the
    bound is tight, and the test above could fail."""
    keep = decoder_keep(model.cfg)
    length = keep + 3 * CHUNK - 1  # the last chunk starts at keep - 1 + 2·CHUNK ... see below
    ids = np.random.default_rng(5).integers(3, 250, (1, length))
    full_logits, full_cache, _ = prefill(model, ids, None)
    # Skip every chunk that ends at or before L − keep + CHUNK: the decoder misses some positions it needs.
    logits, cache, _ = prefill(model, ids, keep - CHUNK)
    assert np.abs(logits - full_logits).max() > 0 or any(
        not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(cache),
                                                                         jax.tree.leaves(full_cache)))


def test_replay_is_approximate_and_measured(model):
    """DeepInfer's bounded replay: the decoder on the last window + 12 positions, its windows cut there. Its
    error against the exact form is real and small relative to the logits (measured here on random weights)."""
    ids = np.random.default_rng(9).integers(3, 250, (1, 70))
    exact, _, _ = prefill(model, ids, decoder_keep(model.cfg))
    approx, _, skipped = prefill(model, ids, replay_keep(model.cfg), replay=True)
    assert skipped > 3
    err = np.abs(approx - exact).max() / np.abs(exact).max()
    assert 0 < err < 1.0, err


@pytest.mark.heavy
def test_engine_exact_prefill_equals_full(model):
    """Through the engine (continuous batching, row buckets, precompiled programs): the same greedy tokens with
    the decoder truncated as with every layer on every token, and the encoder-only chunks really ran."""
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 250, n)) for n in (70, 100)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[])
    out, chunks = {}, {}
    for mode in ("full", "exact"):
        engine = Engine(model, RunConfig(slots=2, max_len=128, chunk_size=CHUNK, decoder_prefill=mode))
        engine.precompile()
        before = Engine.compilations()
        out[mode] = [r.tokens for r in dsjax.generate(model, prompts, sp, engine=engine)]
        assert Engine.compilations() == before  # nothing compiled inside the job
        chunks[mode] = engine.encoder_chunks
    assert out["exact"] == out["full"]
    assert chunks["full"] == 0 and chunks["exact"] > 0
