"""Lightning indexer: the selected entries per query equal the reference's top-k picks, and the cached
picks equal the uncached ones."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.cache import layer_cache
from dsjax.config import CSA, ModelConfig
from dsjax.model import DeepseekV4
from tests.helpers import CASES, layers_of


def ref_selection(idx_bsk, n_entries):
    b, s, _ = idx_bsk.shape
    sel = np.zeros((b, s, n_entries), bool)
    for bi in range(b):
        for si in range(s):
            for j in idx_bsk[bi, si]:
                if j >= 0:
                    sel[bi, si, j] = True
    return sel


@pytest.mark.parametrize("case", list(CASES))
def test_indexer_selection_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    layers = layers_of(model.cfg, CSA)
    assert layers
    dropped = False
    for i in layers:
        indexer = model.layer(i).self_attn.compressor.indexer
        x = jnp.asarray(cap[f"L{i}.indexer.in0"])
        q_res = jnp.asarray(cap[f"L{i}.indexer.in1"])
        pos = jnp.broadcast_to(jnp.asarray(cap[f"L{i}.indexer.in2"]), x.shape[:2])
        ours = np.asarray(indexer(x, q_res, pos))
        ref_idx = cap[f"L{i}.indexer.out0"].astype(np.int64)
        np.testing.assert_array_equal(ours, ref_selection(ref_idx, ours.shape[-1]), err_msg=f"layer {i}")
        # Selection margins: the k-th and (k+1)-th visible scores must differ, or ties decide.
        scores, visible = indexer.scores(x, q_res, pos)
        scores, visible = np.asarray(scores), np.asarray(visible)
        k = model.cfg.index_topk
        for row, vis in zip(scores.reshape(-1, scores.shape[-1]), visible.reshape(-1, visible.shape[-1])):
            v = np.sort(row[vis])[::-1]
            if len(v) > k:
                dropped = True
                assert v[k - 1] - v[k] > 1e-6 * max(1.0, abs(v[k - 1])), "top-k boundary tie"
    assert dropped, "no query had more visible entries than index_topk"


def test_cached_picks_match_the_uncached_selection():
    """`Indexer.extend` (a chunk through XLA, then a decode step through `index_scores`) picks, per query,
    the entries `__call__` selects for the whole sequence."""
    cfg = ModelConfig.preset("tiny")
    model = DeepseekV4(cfg, rngs=nnx.Rngs(4))
    layer = model.layer(layers_of(cfg, CSA)[0])
    indexer = layer.self_attn.compressor.indexer
    rng = np.random.default_rng(1)
    x_bsh = jnp.asarray(rng.normal(size=(2, 29, cfg.hidden_size)), jnp.float32)
    q_res_bsr = layer.self_attn.q_a_norm(layer.self_attn.q_a_proj(x_bsh))
    pos_bs = jnp.broadcast_to(jnp.arange(29), (2, 29))
    want = np.asarray(indexer(x_bsh, q_res_bsr, pos_bs))
    state = layer_cache(cfg, CSA, 2, 32, jnp.float32).indexer
    chunk, state = indexer.extend(x_bsh[:, :28], q_res_bsr[:, :28], pos_bs[:, :28], jnp.zeros(2, jnp.int32),
                                  jnp.full(2, 28), state)
    step, _ = indexer.extend(x_bsh[:, 28:], q_res_bsr[:, 28:], pos_bs[:, 28:], jnp.full(2, 28), jnp.ones(2, jnp.int32),
                             state)
    assert chunk.entries_len_bc is None and step.idx_bck.shape[1] == 1
    picks = np.concatenate([ref_selection(np.asarray(s.idx_bck), want.shape[-1]) for s in (chunk, step)], axis=1)
    np.testing.assert_array_equal(picks, want)
