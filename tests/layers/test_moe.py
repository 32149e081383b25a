"""The MoE block (router + routed experts + shared expert) against the reference."""

import jax.numpy as jnp
import pytest

from tests.helpers import CASES, assert_close


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    ids = jnp.asarray(cap["input_ids"])
    for i in range(CASES[case]):
        out = model.layer(i).mlp(jnp.asarray(cap[f"L{i}.mlp.in0"]), ids)
        assert_close(out, cap[f"L{i}.mlp.out0"], what=f"{case} layer {i}")
