"""Whole decoder layers (mHC + attention + MoE on N streams) against the reference."""

import jax.numpy as jnp
import pytest

from tests.helpers import CASES, assert_close


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_layers_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    ids = jnp.asarray(cap["input_ids"])
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    for i in range(CASES[case]):
        out = model.layer(i)(jnp.asarray(cap[f"L{i}.layer.in0"]), pos, ids)
        assert_close(out, cap[f"L{i}.layer.out0"], what=f"{case} layer {i}")
