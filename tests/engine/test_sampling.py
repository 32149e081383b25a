"""The on-device sampler: distribution, filtering, greedy, logprobs, parameter validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.engine.grammar import full_masks, only
from dsjax.engine.sampling import MAX_LOGPROBS, SamplingArrays, SamplingModes, SamplingParams, allowed_tokens, sample

LOGITS = np.log(np.asarray([0.05, 0.3, 0.1, 0.25, 0.02, 0.08, 0.2], np.float64)).astype(np.float32)


def draw(n, **kw):
    params = SamplingArrays.of([SamplingParams(**kw)] * n, np.arange(n) + 17)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    return np.asarray(jax.jit(sample)(logits, params, jnp.zeros(n, jnp.int32)).token)


def test_frequencies_match_softmax_chi_square():
    n = 20000
    counts = np.bincount(draw(n, temperature=1.0), minlength=LOGITS.size)
    expected = n * np.exp(LOGITS) / np.exp(LOGITS).sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 22.46, chi2  # chi-square, 6 degrees of freedom, p = 0.001


def test_temperature_sharpens():
    n = 5000
    hot = np.bincount(draw(n, temperature=2.0), minlength=LOGITS.size) / n
    cold = np.bincount(draw(n, temperature=0.3), minlength=LOGITS.size) / n
    assert cold[1] > 0.5 > hot[1]


def test_top_k_and_top_p_never_emit_excluded_tokens():
    assert set(draw(3000, temperature=1.0, top_k=2)) == {1, 3}
    # top_p=0.6: sorted masses 0.3, 0.25, 0.2 ...: the first two cover 0.55 < 0.6, so three stay.
    assert set(draw(3000, temperature=1.0, top_p=0.6)) == {1, 3, 6}
    # top-p applies to the top-k renormalised masses 0.4, 0.33, 0.27: 0.45 keeps two.
    assert set(draw(3000, temperature=1.0, top_k=3, top_p=0.45)) == {1, 3}


def test_greedy_and_logprobs():
    out = sample(jnp.asarray([LOGITS]), SamplingArrays.of([SamplingParams(temperature=0.0, logprobs=3)], [0]),
                 jnp.asarray([0]))
    logp = LOGITS - np.log(np.exp(LOGITS).sum())
    assert int(out.token[0]) == 1
    np.testing.assert_allclose(float(out.logprob[0]), logp[1], rtol=1e-6)
    assert out.top_ids.shape == (1, min(MAX_LOGPROBS, LOGITS.size))
    np.testing.assert_array_equal(np.asarray(out.top_ids[0, :3]), [1, 3, 6])
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0, :3]), logp[[1, 3, 6]], rtol=1e-6)


def test_alternatives_only_when_some_row_asks():
    """Without a row asking for alternatives the vocabulary is not ranked (zeros come back); with one,
    every row gets its own, and the chosen token's logprob is there either way."""
    logits = jnp.asarray([LOGITS, LOGITS[::-1]])
    logp = LOGITS - np.log(np.exp(LOGITS).sum())
    step = jax.jit(sample)
    none = step(logits, SamplingArrays.of([SamplingParams(temperature=0.0)] * 2, [0, 1]), jnp.zeros(2, jnp.int32))
    assert not np.asarray(none.top_ids).any() and not np.asarray(none.top_logprobs).any()
    np.testing.assert_allclose(np.asarray(none.logprob), [logp[1], logp[1]], rtol=1e-6)
    asks = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2)]
    mixed = step(logits, SamplingArrays.of(asks, [0, 1]), jnp.zeros(2, jnp.int32))
    np.testing.assert_array_equal(np.asarray(mixed.top_ids[:, :2]), [[1, 3], [5, 3]])
    np.testing.assert_array_equal(np.asarray(mixed.token), np.asarray(none.token))


def test_position_changes_the_draw_seed_fixes_it():
    params = SamplingArrays.of([SamplingParams(temperature=1.0)] * 64, [5] * 64)
    logits = jnp.zeros((64, 1000))
    at = lambda p: np.asarray(sample(logits, params, jnp.full((64,), p)).token)  # noqa: E731
    assert len(set(at(0))) == 1 and at(0)[0] == at(0)[0]
    assert len({int(at(p)[0]) for p in range(20)}) > 10


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                dict(max_tokens=0), dict(logprobs=21), dict(seed=-1)])
def test_invalid_params_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_tied_logits_are_sampled_by_each_tokens_own_noise_whatever_the_batch():
    """Among exactly tied tokens the pick is the one whose own Gumbel draw is largest: it must not depend
    on where a sort puts ties. (It did: the noise was drawn per rank, and two tied tokens swapped between
    two jobs holding the same request, caught by the job's interrupt-and-resume test.)"""
    vocab = 4096
    flat = jnp.zeros((1, vocab), jnp.float32)
    params = SamplingArrays.of([SamplingParams(temperature=1.0)], [77])
    token = int(sample(flat, params, jnp.asarray([9])).token[0])
    own_noise = jax.random.gumbel(jax.random.fold_in(jax.random.key(77), 9), (vocab,), jnp.float32)
    assert token == int(jnp.argmax(own_noise))

    rng = np.random.default_rng(0)
    row = jnp.asarray(np.round(rng.normal(size=(1, vocab)), 1), jnp.float32)  # many exact ties
    for seed in range(20):
        alone = sample(row, SamplingArrays.of([SamplingParams(temperature=1.0, top_k=50)], [seed]), jnp.asarray([3]))
        others = jnp.asarray(np.round(rng.normal(size=(3, vocab)), 1), jnp.float32)
        batch = jnp.concatenate([others[:2], row, others[2:]])
        sp = SamplingArrays.of([SamplingParams(temperature=1.0, top_k=50)] * 4, [seed + 1, seed + 2, seed, 5])
        together = sample(batch, sp, jnp.asarray([1, 2, 3, 4]))
        assert int(alone.token[0]) == int(together.token[2])


def test_unfiltered_rows_skip_the_sort_and_pick_what_the_sorted_path_picks():
    """Rows without top-k/top-p take the Gumbel-max on unsorted logits; with the same noise the
    sorted path (taken when any row filters) picks the same tokens, so a row's token does not depend
    on whether another row in its batch filters."""
    from dsjax.engine.sampling import _sample_filtered, _sample_plain

    logits = jax.random.normal(jax.random.key(3), (16, 1000)) * 3
    params = SamplingArrays.of([SamplingParams(temperature=t) for t in np.linspace(0.3, 2.0, 16)], list(range(16)))
    pos = jnp.arange(16, dtype=jnp.int32) * 7
    np.testing.assert_array_equal(_sample_plain(logits, params, pos), _sample_filtered(logits, params, pos))
    alone = sample(logits, params, pos).token  # row 0: temperature 0.3 either way
    with_filter = sample(logits, SamplingArrays.of(
        [SamplingParams(temperature=0.3)] + [SamplingParams(temperature=1.0, top_k=5)] * 15, list(range(16))), pos).token
    assert int(alone[0]) == int(with_filter[0])


def test_modes_are_what_the_rows_need_and_wider_modes_pick_the_same_tokens():
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    assert SamplingModes.of([greedy]) == SamplingModes(False, False, False)
    assert SamplingModes.of([greedy, hot]) == SamplingModes(True, False, False)
    # a greedy row's top-k does not make the batch filter; a sampled row's does
    assert SamplingModes.of([SamplingParams(temperature=0.0, top_k=3)]) == SamplingModes(False, False, False)
    assert SamplingModes.of([SamplingParams(temperature=0.5, top_p=0.9)]) == SamplingModes(True, True, False)
    assert SamplingModes.of([SamplingParams(logprobs=0)]).logprobs is False
    assert SamplingModes.of([SamplingParams(logprobs=1)]).logprobs is True
    widened = SamplingArrays.of([greedy], [0], SamplingModes(False, True, False))
    assert widened.modes == SamplingModes(False, True, False)

    logits = jax.random.normal(jax.random.key(1), (6, 300)) * 2
    rows = [greedy, hot, greedy, SamplingParams(temperature=1.3), hot, greedy]
    pos = jnp.arange(6, dtype=jnp.int32)
    need = sample(logits, SamplingArrays.of(rows, list(range(6))), pos)
    wide = sample(logits, SamplingArrays.of(rows, list(range(6)), SamplingModes()), pos)
    np.testing.assert_array_equal(np.asarray(need.token), np.asarray(wide.token))
    np.testing.assert_array_equal(np.asarray(need.logprob), np.asarray(wide.logprob))
    only_greedy = sample(logits, SamplingArrays.of([greedy] * 6, list(range(6))), pos)
    np.testing.assert_array_equal(np.asarray(only_greedy.token), np.asarray(jnp.argmax(logits, -1)))


def _masks(rows_allowed, vocab):
    masks = np.zeros((len(rows_allowed), (vocab + 31) // 32), np.int32)
    for r, allowed in enumerate(rows_allowed):
        only(masks, r, allowed)
    return masks


def test_the_bit_masks_unpack_to_the_allowed_tokens():
    rng = np.random.default_rng(0)
    vocab = 70  # a partial last word
    rows = [sorted(rng.choice(vocab, k, replace=False).tolist()) for k in (1, 5, 31, 32, 33, 70)]
    got = np.asarray(allowed_tokens(jnp.asarray(_masks(rows, vocab)), vocab))
    for r, allowed in enumerate(rows):
        assert np.flatnonzero(got[r]).tolist() == allowed
    assert np.asarray(allowed_tokens(jnp.asarray(full_masks(2, vocab)), vocab)).all()


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.5),
                                dict(temperature=0.7, top_k=2)])
def test_masked_rows_pick_only_allowed_tokens_with_the_models_logprobs(kw):
    n = 600
    allowed = [[0, 4], [5], [2, 4, 5]]
    masks = jnp.asarray(_masks([allowed[i % 3] for i in range(n)], LOGITS.size))
    params = SamplingArrays.of([SamplingParams(**kw)] * n, np.arange(n) + 3)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    out = jax.jit(sample)(logits, params, jnp.zeros(n, jnp.int32), masks)
    tokens = np.asarray(out.token)
    for i in range(3):
        picked = set(tokens[i::3].tolist())
        assert picked <= set(allowed[i])
        if kw["temperature"] == 0:
            assert picked == {max(allowed[i], key=lambda t: LOGITS[t])}
    own = jax.nn.log_softmax(jnp.asarray(LOGITS))
    np.testing.assert_array_equal(np.asarray(out.logprob), np.asarray(own)[tokens])


def test_masked_sampling_draws_from_the_renormalised_allowed_distribution():
    n, allowed = 20000, [1, 2, 6]
    masks = jnp.asarray(_masks([allowed] * n, LOGITS.size))
    params = SamplingArrays.of([SamplingParams(temperature=1.0)] * n, np.arange(n) + 11)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    tokens = np.asarray(jax.jit(sample)(logits, params, jnp.zeros(n, jnp.int32), masks).token)
    counts = np.bincount(tokens, minlength=LOGITS.size)[allowed]
    p = np.exp(LOGITS[allowed]) / np.exp(LOGITS[allowed]).sum()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 13.82, chi2  # chi-square, 2 degrees of freedom, p = 0.001


def test_a_full_mask_changes_nothing():
    n = 64
    params = SamplingArrays.of([SamplingParams(temperature=0.8, top_p=0.9)] * n, np.arange(n))
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(n, 300)).astype(np.float32))
    plain = jax.jit(sample)(logits, params, jnp.arange(n))
    masked = jax.jit(sample)(logits, params, jnp.arange(n), jnp.asarray(full_masks(n, 300)))
    np.testing.assert_array_equal(np.asarray(plain.token), np.asarray(masked.token))
