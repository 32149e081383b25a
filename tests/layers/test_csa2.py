"""CSA2's pieces against independent numpy formulations of spec §2.4: the candidate block pool, the top-k
picks and their mask, and the ratio-2 / ratio-1 compressors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.config_v41 import V41Config
from dsjax.layers.csa2 import CSA2Compressor, candidate_blocks, candidate_mask, picked_mask, picks_in_pool
from dsjax.layers.topk import top_picks

CFG = V41Config.preset("tiny-v4.1")


# ------------------------------------------------------------------------------------ candidate pool

def ref_candidate_blocks(score_bst, visible_len_bs, top_blocks, block):
    """Spec §2.4, one query at a time: blocks of `block` entries (the last one short when T is not a multiple),
    a block's score is its best entry's, the block holding the newest visible entry counts as +inf, the
    `top_blocks` best blocks are kept unless their score is −inf; a kept block's entries are candidates."""
    b, s, t = score_bst.shape
    n_blocks = -(-t // block)
    out = np.zeros((b, s, t), bool)
    for bi in range(b):
        for si in range(s):
            row = score_bst[bi, si]
            scores = np.array([row[k * block:(k + 1) * block].max() for k in range(n_blocks)])
            n_vis = visible_len_bs[bi, si]
            if n_vis > 0:
                scores[(n_vis - 1) // block] = np.inf
            order = sorted(range(n_blocks), key=lambda k: -scores[k])  # no ties among finite scores here
            for k in order[:top_blocks]:
                if scores[k] > -np.inf:
                    out[bi, si, k * block:(k + 1) * block] = True
    return out


def _visible_scores(rng, b, s, t, visible_len_bs, holes=0.15):
    """Distinct random scores, −inf at and past each query's visible length and at a few random holes."""
    score = rng.permutation(b * s * t).reshape(b, s, t).astype(np.float32) / (b * s * t) + rng.normal(size=(b, s, t))
    score = score.astype(np.float32)
    score[np.arange(t)[None, None, :] >= visible_len_bs[..., None]] = -np.inf
    score[rng.random((b, s, t)) < holes] = -np.inf
    return score


def select_candidate_blocks(score_bst, visible_len_bs, top_blocks, block):
    """The pool as a `[B,S,T]` mask, to compare with the numpy formulation."""
    return candidate_mask(candidate_blocks(score_bst, visible_len_bs, top_blocks, block), score_bst.shape[-1], block)


_select = jax.jit(select_candidate_blocks, static_argnums=(2, 3))


@pytest.mark.parametrize("t, block, top_blocks", [(32, 8, 2), (21, 4, 3), (19, 8, 2), (13, 4, 10), (16, 1, 5)])
def test_candidate_blocks_match_numpy(t, block, top_blocks):
    rng = np.random.default_rng(t * 100 + block)
    b, s = 2, 9
    visible = rng.integers(0, t + 1, (b, s))
    visible[0, :3] = [0, 1, t]  # no entry visible yet, one, all
    score = _visible_scores(rng, b, s, t, visible)
    got = np.asarray(_select(jnp.asarray(score), jnp.asarray(visible), top_blocks, block))
    want = ref_candidate_blocks(score, visible, top_blocks, block)
    assert got.shape == (b, s, t) and got.dtype == np.bool_
    np.testing.assert_array_equal(got, want)
    assert not got[0, 0].any()  # nothing visible: no candidate at all


def test_candidate_blocks_by_hand():
    """T = 10 in blocks of 4 (the last of 2); the best two blocks, the newest visible entry's pinned."""
    ninf = -np.inf
    score = np.array([[[5, 1, 0, 0, 3, 0, 0, 0, 0.5, ninf],  # 9 visible: block 2 (0.5) pinned beside block 0 (5)
                       [0, 0, 0, 0, 1, 0, 0, 0, 9, 2],  # 10 visible: block 2 (9), then block 1 (1)
                       [ninf, ninf, ninf, 1, ninf, ninf, ninf, ninf, ninf, ninf],  # 4 visible: one finite block
                       [ninf] * 10]]).astype(np.float32)  # nothing visible
    visible = np.array([[9, 10, 4, 0]])
    got = np.asarray(select_candidate_blocks(jnp.asarray(score), jnp.asarray(visible), 2, 4))
    want = np.zeros((1, 4, 10), bool)
    want[0, 0, :4] = want[0, 0, 8:] = True
    want[0, 1, 4:] = True
    want[0, 2, :4] = True  # the pinned block; the other top block is −inf and dropped
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ref_candidate_blocks(score, visible, 2, 4))


def test_candidate_blocks_are_the_pool_as_a_list():
    """The pool as increasing block indices, −1 at the end for blocks with no finite score."""
    ninf = -np.inf
    score = np.array([[[5, 1, 0, 0, 3, 0, 0, 0, 0.5, ninf],
                       [ninf, ninf, ninf, 1, ninf, ninf, ninf, ninf, ninf, ninf],
                       [ninf] * 10]]).astype(np.float32)
    got = np.asarray(candidate_blocks(jnp.asarray(score), jnp.asarray([[9, 4, 0]]), 2, 4))
    np.testing.assert_array_equal(got, [[[0, 2], [0, -1], [-1, -1]]])


_pool_picks = jax.jit(picks_in_pool, static_argnums=(2, 3))


@pytest.mark.parametrize("t, block, top_blocks, k", [(64, 8, 3, 5), (21, 4, 3, 6), (13, 4, 10, 20), (30, 2, 4, 8),
                                                     (40, 4, 2, 16)])
def test_picks_in_pool_equal_a_top_k_of_the_masked_scores(t, block, top_blocks, k):
    """A Reindex layer's picks from its pool's gathered scores equal one stable top-k over every entry with
    the entries outside the pool at −inf (ties to the lower index: the scores are rounded to force ties)."""
    rng = np.random.default_rng(t + 7 * block + k)
    b, s = 2, 7
    visible = rng.integers(0, t + 1, (b, s))
    visible[0, :3] = [0, 1, t]
    score = np.round(_visible_scores(rng, b, s, t, visible), 1)
    blocks = candidate_blocks(jnp.asarray(score), jnp.asarray(visible), top_blocks, block)
    got = np.asarray(_pool_picks(jnp.asarray(score), blocks, block, k))
    pool = ref_candidate_blocks(score, visible, top_blocks, block)
    assert got.shape == (b, s, min(k, t))
    for row, keep, picks in zip(score.reshape(-1, t), pool.reshape(-1, t), got.reshape(-1, min(k, t))):
        masked = np.where(keep, row, -np.inf)
        best = np.argsort(-masked, kind="stable")[:k]
        want = np.sort(best[masked[best] > -np.inf])
        np.testing.assert_array_equal(picks, np.pad(want, (0, min(k, t) - want.size), constant_values=-1))


# ------------------------------------------------------------------------------------------ top-k picks

def test_picked_mask():
    picks = jnp.asarray([[[0, 3, -1], [2, -1, -1]], [[-1, -1, -1], [1, 2, 4]]], jnp.int32)
    got = np.asarray(picked_mask(picks, 5))
    want = np.zeros((2, 2, 5), bool)
    want[0, 0, [0, 3]] = True
    want[0, 1, 2] = True
    want[1, 1, [1, 2, 4]] = True
    np.testing.assert_array_equal(got, want)
    # Round trip with top_picks: the picked mask of random scores' picks is the set of the k best finite ones.
    rng = np.random.default_rng(3)
    score = rng.normal(size=(2, 5, 12)).astype(np.float32)
    score[rng.random(score.shape) < 0.5] = -np.inf
    mask = np.asarray(picked_mask(top_picks(jnp.asarray(score), 4), 12))
    for row, m in zip(score.reshape(-1, 12), mask.reshape(-1, 12)):
        best = np.argsort(-row, kind="stable")[:4]
        np.testing.assert_array_equal(np.flatnonzero(m), np.sort(best[row[best] > -np.inf]))


# ------------------------------------------------------------------------------------------ compressors

def _rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _compressor(ratio: int, seed: int = 0) -> CSA2Compressor:
    comp = CSA2Compressor(CFG, ratio, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    h, d = CFG.hidden_size, CFG.head_dim
    # Weights large enough that the pair softmax is far from uniform, and a norm weight that is not ones.
    comp.kv_proj.weight.set_value(jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(h), jnp.float32))
    if comp.gate_proj is not None:
        comp.gate_proj.weight.set_value(jnp.asarray(3 * rng.normal(size=(d, h)) / np.sqrt(h), jnp.float32))
    comp.kv_norm.weight.set_value(jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32))
    return comp


def test_ratio_2_pools_complete_pairs_with_softmax_weights():
    comp = _compressor(2)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 7, CFG.hidden_size)).astype(np.float32)
    got = np.asarray(comp(jnp.asarray(x)))
    assert got.shape == (2, 3, CFG.head_dim)  # 7 tokens: pairs (0,1), (2,3), (4,5); token 6 waits
    wkv = np.asarray(comp.kv_proj.weight[...], np.float64)
    wgate = np.asarray(comp.gate_proj.weight[...], np.float64)
    norm_w = np.asarray(comp.kv_norm.weight[...], np.float64)
    xd = x.astype(np.float64)
    want = np.zeros((2, 3, CFG.head_dim))
    spread = 0.0
    for bi in range(2):
        for j in range(3):
            a, b = xd[bi, 2 * j], xd[bi, 2 * j + 1]
            ga, gb = wgate @ a, wgate @ b
            wa = np.exp(ga) / (np.exp(ga) + np.exp(gb))  # per channel, over the pair's two tokens
            spread = max(spread, np.abs(wa - 0.5).max())
            pooled = wa * (wkv @ a) + (1 - wa) * (wkv @ b)
            want[bi, j] = _rms_norm(pooled, norm_w, CFG.rms_norm_eps)
    assert spread > 0.3  # the softmax weights are far from an average
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # The odd trailing token makes no entry and changes none: six tokens give the same three entries.
    x2 = x.copy()
    x2[:, 6] = rng.normal(size=(2, CFG.hidden_size))
    np.testing.assert_array_equal(np.asarray(comp(jnp.asarray(x2))), got)
    np.testing.assert_array_equal(np.asarray(comp(jnp.asarray(x[:, :6]))), got)


def test_ratio_2_with_no_complete_pair_makes_no_entry():
    comp = _compressor(2)
    x = np.random.default_rng(1).normal(size=(2, 1, CFG.hidden_size)).astype(np.float32)
    assert comp(jnp.asarray(x)).shape == (2, 0, CFG.head_dim)


def test_ratio_1_is_the_normed_projection_of_each_token():
    comp = _compressor(1, seed=2)
    assert comp.gate_proj is None
    x = np.random.default_rng(4).normal(size=(2, 5, CFG.hidden_size)).astype(np.float32)
    got = np.asarray(comp(jnp.asarray(x)))
    assert got.shape == (2, 5, CFG.head_dim)  # one entry per token, an odd count included
    wkv = np.asarray(comp.kv_proj.weight[...], np.float64)
    want = _rms_norm(x.astype(np.float64) @ wkv.T, np.asarray(comp.kv_norm.weight[...], np.float64), CFG.rms_norm_eps)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
