"""HCA and CSA compressors against the reference: entries and their visibility masks."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import CSA, HCA
from tests.helpers import CASES, assert_close, layers_of


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_entries_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    checked = set()
    for i in layers_of(model.cfg, CSA) + layers_of(model.cfg, HCA):
        comp = model.layer(i).self_attn.compressor
        x = jnp.asarray(cap[f"L{i}.compressor.in0"])
        ref_entries = cap[f"L{i}.compressor.out0"][:, 0]  # [B,1,T,D] -> [B,T,D]
        assert ref_entries.shape[1] > 0
        assert_close(comp.compress(x), ref_entries, what=f"{case} layer {i}")
        checked.add(model.cfg.layer_types[i])
    assert checked == {CSA, HCA}


@pytest.mark.parametrize("case", list(CASES))
def test_hca_visibility_matches_reference_bias(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in layers_of(model.cfg, HCA):
        x = jnp.asarray(cap[f"L{i}.compressor.in0"])
        q_res = jnp.asarray(cap[f"L{i}.compressor.in1"])
        pos = jnp.asarray(cap[f"L{i}.compressor.in2"])
        pos = jnp.broadcast_to(pos, x.shape[:2])
        _, visible = model.layer(i).self_attn.compressor(x, q_res, pos)
        ref_bias = cap[f"L{i}.compressor.out1"][:, 0]  # 0 where visible, -inf elsewhere
        np.testing.assert_array_equal(np.asarray(visible), ref_bias == 0)
        assert not np.all(ref_bias == 0) and np.any(ref_bias == 0)
