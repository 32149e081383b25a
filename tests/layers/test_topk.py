"""The indexer's top-k pick (`layers/topk.py`): against a plain sort, by hand, and the two-step pick
against one `lax.top_k` over every entry, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.topk import pick_block, top_picks


def ref_top_picks(score_bst, k):
    """Per query: the k = min(k, T) best entries, ties to the lower index, −inf picks dropped, the rest in
    increasing order, padded with −1."""
    b, s, t = score_bst.shape
    k = min(k, t)
    out = np.full((b, s, k), -1, np.int64)
    for bi in range(b):
        for si in range(s):
            row = score_bst[bi, si]
            order = sorted(range(t), key=lambda j: (-row[j], j))[:k]
            kept = sorted(j for j in order if row[j] > -np.inf)
            out[bi, si, :len(kept)] = kept
    return out


@pytest.mark.parametrize("t, k", [(20, 8), (6, 8), (8, 8), (1, 3)])
def test_top_picks_match_numpy_with_ties(t, k):
    rng = np.random.default_rng(t + k)
    # Scores from a few values only, so most rows hold ties; some −inf, and one row of only −inf.
    score = rng.integers(-3, 3, (2, 7, t)).astype(np.float32)
    score[rng.random(score.shape) < 0.3] = -np.inf
    score[1, 0] = -np.inf
    got = np.asarray(top_picks(jnp.asarray(score), k))
    assert got.dtype == np.int32 and got.shape == (2, 7, min(k, t))
    np.testing.assert_array_equal(got, ref_top_picks(score, k))
    assert (got[1, 0] == -1).all()


def test_top_picks_by_hand():
    score = jnp.asarray([[[0.5, 2.0, -np.inf, 2.0, 1.0, 0.5]]], jnp.float32)
    # Top 3: 2.0 at 1 and 3, then 1.0 at 4; top 5: then the 0.5 at 0 (the lower of the tied pair).
    assert np.asarray(top_picks(score, 3)).tolist() == [[[1, 3, 4]]]
    assert np.asarray(top_picks(score, 5)).tolist() == [[[0, 1, 3, 4, 5]]]
    # k ≥ T: all six, the −inf one as −1 at the end.
    assert np.asarray(top_picks(score, 9)).tolist() == [[[0, 1, 3, 4, 5, -1]]]



@pytest.mark.parametrize("t, k, block", [(200, 8, 4), (203, 8, 16), (64, 8, 8), (1000, 16, None), (37, 5, 3),
                                         (4000, 8, None)])
def test_two_step_pick_equals_one_top_k_with_ties(t, k, block):
    """Blocks of `block` entries (the last one partial where `block` does not divide T; 4,000 entries pick
    their blocks in two steps again); scores from a few values, so ties straddle blocks; −inf entries; one
    row all −inf, one with fewer finite than k."""
    rng = np.random.default_rng(t * k)
    score = rng.integers(-4, 4, (2, 9, t)).astype(np.float32)
    score[rng.random(score.shape) < 0.3] = -np.inf
    score[1, 0] = -np.inf
    score[1, 1, k // 2:] = -np.inf
    want = np.asarray(top_picks(jnp.asarray(score), k, block=1))
    got = np.asarray(jax.jit(lambda s: top_picks(s, k, block=block))(jnp.asarray(score)))
    assert (block or pick_block(t, k)) > 1
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ref_top_picks(score, k))


def test_two_step_pick_on_distinct_scores_at_long_rows():
    """Continuous scores over 65,536 entries with a causal −inf tail per query, as a prefill chunk sees them."""
    rng = np.random.default_rng(0)
    t, k = 65536, 512
    score = rng.standard_normal((1, 4, t)).astype(np.float32)
    for i, n in enumerate((0, 100, 5000, t)):
        score[0, i, n:] = -np.inf
    assert pick_block(t, k) == 16
    got = np.asarray(top_picks(jnp.asarray(score), k))
    for i, n in enumerate((0, 100, 5000, t)):
        want = np.sort(np.argsort(-score[0, i, :n], kind="stable")[:k])
        np.testing.assert_array_equal(got[0, i, :len(want)], want)
        assert (got[0, i, len(want):] == -1).all()


def test_pick_block():
    assert pick_block(0, 0) == 1 and pick_block(1000, 512) == 1 and pick_block(4095, 512) == 1 and pick_block(4096, 512) == 4
    assert pick_block(262144, 512) in (16, 32) and pick_block(65536, 512) == 16
