"""RMSNorm variants against the reference and their bf16 casting rules."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.norms import unweighted_rms_norm
from tests.helpers import CASES, assert_close


@pytest.mark.parametrize("case", list(CASES))
def test_input_layernorm_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in range(CASES[case]):
        norm = model.layer(i).input_layernorm
        assert_close(norm(jnp.asarray(cap[f"L{i}.input_layernorm.in0"])), cap[f"L{i}.input_layernorm.out0"])


def test_unweighted_rms_norm_casts_factor_before_multiply():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)) * 3, jnp.bfloat16)
    factor = (1 / np.sqrt((np.asarray(x, np.float32) ** 2).mean(-1, keepdims=True) + 1e-6))
    expect = np.asarray(x) * factor.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(unweighted_rms_norm(x, 1e-6)), expect)
