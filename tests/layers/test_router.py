"""Top-k and hash routers against the reference: the same experts with the same weights."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import HASH_MOE, MOE
from tests.helpers import CASES, assert_close, layers_of


def sorted_pairs(idx, w):
    order = np.argsort(idx, axis=-1)
    return np.take_along_axis(idx, order, -1), np.take_along_axis(w, order, -1)


@pytest.mark.parametrize("case", list(CASES))
def test_routers_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    ids = jnp.asarray(cap["input_ids"]).reshape(-1)
    kinds = set()
    for i in range(CASES[case]):
        gate = model.layer(i).mlp.gate
        x = jnp.asarray(cap[f"L{i}.gate.in0"])
        w, idx = gate(x.reshape(-1, x.shape[-1]), ids)
        ref_idx, ref_w = sorted_pairs(cap[f"L{i}.gate.out2"].astype(np.int64), cap[f"L{i}.gate.out1"])
        got_idx, got_w = sorted_pairs(np.asarray(idx), np.asarray(w))
        np.testing.assert_array_equal(got_idx, ref_idx, err_msg=f"layer {i}")
        assert_close(got_w, ref_w, what=f"{case} layer {i} weights")
        kinds.add(model.cfg.mlp_layer_types[i])
    assert kinds == {HASH_MOE, MOE}


def test_correction_bias_changes_selection_only(load_case):
    model = load_case("mixed")
    i = next(iter(layers_of(model.cfg, mlp_type=MOE)))
    gate = model.layer(i).mlp.gate
    x = jnp.asarray(np.random.default_rng(1).standard_normal((32, model.cfg.hidden_size)), jnp.float32)
    w, idx = gate(x, jnp.zeros(32, jnp.int32))
    scores = np.asarray(gate.scores(x))
    expect = np.take_along_axis(scores, np.asarray(idx), -1)
    expect = expect / expect.sum(-1, keepdims=True) * model.cfg.routed_scaling_factor
    np.testing.assert_allclose(np.asarray(w), expect, rtol=1e-6)
