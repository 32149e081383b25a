"""Lightning indexer: the selected entries per query equal the reference's top-k picks."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import CSA
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
